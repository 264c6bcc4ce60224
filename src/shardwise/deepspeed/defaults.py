"""DeepSpeed's defaults, where they differ from `shardwise.initialize`'s plain-PyTorch ones.

`shardwise.deepspeed.initialize` applies each of them to what the config leaves unsaid, and says so in one info line
per default (rank 0), so an imports-only port trains as it did under DeepSpeed (docs/from-deepspeed.md: the table).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from shardwise.config import Config

__all__ = ["DialectChoice", "apply_defaults", "announce"]

logger = logging.getLogger("shardwise")

#: DeepSpeed's `GRADIENT_CLIPPING_DEFAULT` (deepspeed/runtime/constants.py, 0.14-0.19)
DEEPSPEED_CLIPPING = 1.0


@dataclass(frozen=True)
class DialectChoice:
    """One default the dialect applied: what, and what `shardwise.initialize` would have done."""

    what: str
    otherwise: str

    def line(self) -> str:
        return f"deepspeed dialect: {self.what} (DeepSpeed's default; `shardwise.initialize` would {self.otherwise})"


def apply_defaults(
    config: Config, client_optimizer: bool, user_backward: bool = True, client_scheduler: bool = False
) -> tuple[Config, list[DialectChoice]]:
    """`config` with DeepSpeed's defaults for the keys it leaves unset, and the choices made: clipping at 1.0,
    no RNG restore on load, `weight_decay` 0.0 for `Adam`/`AdamW`, schedules that start at iteration -1, no fp16
    hysteresis at stage 0 and, with `user_backward` (not a pipeline, whose `train_batch` runs backward itself),
    backwards that accumulate. A client optimizer drops the config's `optimizer` section, as DeepSpeed ignores it."""
    choices: list[DialectChoice] = []
    update: dict[str, object] = {}
    if "gradient_clipping" not in config.model_fields_set:
        update["gradient_clipping"] = DEEPSPEED_CLIPPING
        choices.append(DialectChoice(
            f"`gradient_clipping` is not set, so gradients are clipped to norm {DEEPSPEED_CLIPPING}",
            "not clip; set `gradient_clipping: 0` to turn clipping off"))
    if "checkpoint" not in config.model_fields_set or "save_rng_state" not in config.checkpoint.model_fields_set:
        update["checkpoint"] = config.checkpoint.model_copy(update={"save_rng_state": False})
        choices.append(DialectChoice(
            "`load_checkpoint` leaves the RNG state alone (`checkpoint.save_rng_state` is not set)",
            "save and restore it; set `checkpoint.save_rng_state: true` for that"))
    section = config.optimizer
    # `weight_decay: auto` resolves by `auto`'s rule (torch's default) and says so in its own line
    wait_for_auto = "optimizer.params.weight_decay" in config.pending
    # DeepSpeed builds `Adam`/`AdamW` as its FusedAdam / DeepSpeedCPUAdam (weight_decay 0 by default) unless
    # `torch_adam: true`, when torch's own class and defaults apply.
    if (section is not None and not client_optimizer and not wait_for_auto and section.type in ("Adam", "AdamW")
            and "weight_decay" not in section.params and section.params.get("torch_adam") is not True):
        update["optimizer"] = section.model_copy(update={"params": {**section.params, "weight_decay": 0.0}})
        choices.append(DialectChoice(
            f"`optimizer.type: {section.type}` without `weight_decay` gets weight_decay 0.0, as DeepSpeed's fused "
            "and CPU Adam", "use torch's AdamW default, 0.01"))
    if client_optimizer and config.optimizer is not None:
        update["optimizer"] = None
        _on_rank0(logging.WARNING, "deepspeed dialect: an optimizer was passed to `initialize`, so the config's "
                  f"`optimizer` section (`{config.optimizer.type}`) is ignored, as DeepSpeed ignores it; remove the "
                  "section to silence this")
    for key, value, choice in (*_schedule_start(config, client_scheduler), *_stage0_hysteresis(config)):
        update[key] = value
        choices.append(choice)
    if user_backward:
        choices.append(DialectChoice(
            "several `backward` calls before one `step` add up their gradients (each still reduced while autograd runs)",
            "refuse a second `backward` at an accumulation boundary"))
    return config.replace(**update), choices


def _schedule_start(config: Config, client_scheduler: bool) -> list[tuple[str, Any, DialectChoice]]:
    """DeepSpeed's schedules start at iteration -1: the first optimizer step runs at `warmup_min_lr`
    (WarmupCosineLR: 0), step `k` at iteration `k - 1`. A section whose params are all `auto` gives way
    to a scheduler passed to `initialize` (Hugging Face's templates), so nothing of it starts."""
    section = config.scheduler
    if section is None or "deepspeed_start" in section.model_fields_set:
        return []
    if client_scheduler and not section.params and any(p.startswith("scheduler.params.") for p in config.pending):
        return []
    return [("scheduler", section.model_copy(update={"deepspeed_start": True}), DialectChoice(
        f"`scheduler` `{section.type}` starts as DeepSpeed's: optimizer step k runs at the schedule's iteration k-1, "
        "the first at iteration -1's lr", "start at iteration 0; set `scheduler.deepspeed_start` to choose"))]


def _stage0_hysteresis(config: Config) -> list[tuple[str, Any, DialectChoice]]:
    """DeepSpeed's ZeRO-0 fp16 optimizers (FP16_Optimizer, FP16_UnfusedOptimizer) keep no hysteresis:
    every overflow halves the scale, whatever `fp16.hysteresis` says; its ZeRO 1-3 honour the key."""
    fp16 = config.fp16
    if not fp16.enabled or fp16.loss_scale != 0 or config.zero_optimization.stage != 0 or fp16.hysteresis == 1:
        return []
    return [("fp16", fp16.model_copy(update={"hysteresis": 1, "consecutive_hysteresis": False}), DialectChoice(
        f"ZeRO stage 0 fp16 ignores `fp16.hysteresis` ({fp16.hysteresis}): every overflow halves the loss scale",
        "apply the hysteresis at every stage; use `shardwise.initialize` for that"))]


def announce(choices: list[DialectChoice]) -> None:
    """One info line per choice, on rank 0."""
    for choice in choices:
        _on_rank0(logging.INFO, choice.line())


def _on_rank0(level: int, message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.log(level, message)
