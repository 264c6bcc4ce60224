"""Hugging Face's `"auto"` values: what each becomes, and when it is known.

Batch numbers become "not given" (DeepSpeed's rule derives them from the other two and the world size). Keys that depend
on what `initialize` receives stay pending until `Config.resolve` (`_LATER` and the `optimizer` / `scheduler` params
below). Any other key takes the engine's default at load. transformers' `HfTrainerDeepSpeedConfig` fills the same keys
from `TrainingArguments`; this module fills them from what shardwise knows instead (learned from its rules, not copied).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .catalog import is_auto
from .errors import ConfigError, Note
from .registry import OPTIMIZERS, SCHEDULES

__all__ = ["BATCH_KEYS", "Facts", "fill", "resolves_later"]

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

_LATER = {
    "fp16.enabled": "the model's dtype (true for a float16 model, else false)",
    "bf16.enabled": "the model's dtype (true for a bfloat16 model, else false)",
    "zero_optimization.reduce_bucket_size": "hidden_size² from the model's config, else the default",
    "zero_optimization.stage3_prefetch_bucket_size": "0.9 × hidden_size² from the model's config, else the default",
    "zero_optimization.stage3_param_persistence_threshold": "10 × hidden_size from the model's config, else the default",
}
_SCHEDULER_LATER = {
    "total_num_steps": "the total optimizer steps a trainer passes (`Config.resolve(total_num_steps=...)`)",
    "warmup_max_lr": "the optimizer's lr",
    "warmup_min_lr": "0",
    "warmup_num_steps": "0 (no warmup)",
}


def resolves_later(path: str) -> str | None:
    """How the `auto` at `path` resolves at initialize, or None when it resolves at load."""
    if path in _LATER:
        return _LATER[path]
    section, _, rest = path.partition(".params.")
    if section == "optimizer" and rest:
        return "the optimizer passed to initialize when every param is `auto` (the section gives way), else torch's default"
    if section == "scheduler" and rest:
        return "the lr_scheduler passed to initialize when every param is `auto` (the section gives way), else " \
            + _SCHEDULER_LATER.get(rest, "the schedule's default")
    return None


@dataclass(frozen=True)
class Facts:
    """What `initialize` knows that a config file cannot."""

    model: nn.Module | None = None
    optimizer: Any = None
    lr_scheduler: Any = None
    total_num_steps: int | None = None


def fill(data: MutableMapping[str, Any], pending: Mapping[str, str], facts: Facts) -> list[Note]:
    """Replace every pending `auto` in `data` (a config dict) from `facts`; return what each became."""
    notes: list[Note] = []
    passed = {"optimizer": facts.optimizer, "lr_scheduler": facts.lr_scheduler}
    for key, name in (("optimizer", "optimizer"), ("scheduler", "lr_scheduler")):
        # a section whose params are all `auto` gives way to the object passed
        params = data[key].get("params") if isinstance(data.get(key), Mapping) else None
        if passed[name] is not None and isinstance(params, Mapping) and params and all(map(is_auto, params.values())):
            del data[key]
            notes.append(Note(key, f"`{key}`: every param is `auto`, so the {name} passed to initialize is used"))
    # The optimizer's params first: a scheduler's `warmup_max_lr: auto` reads the lr they leave.
    for path in sorted(pending, key=lambda p: _SECTIONS.index(p.split(".")[0])):
        if data.get(path.split(".")[0]) is not None:  # else its section gave way to the object passed
            notes.append(_settle(data, path, facts))
    return notes


_SECTIONS = ("optimizer", "scheduler", "fp16", "bf16", "zero_optimization")
_DTYPES = {"fp16.enabled": torch.float16, "bf16.enabled": torch.bfloat16}
_BUCKETS = {
    "zero_optimization.reduce_bucket_size": ("hidden_size²", lambda h: h * h),
    "zero_optimization.stage3_prefetch_bucket_size": ("0.9 × hidden_size²", lambda h: int(0.9 * h * h)),
    "zero_optimization.stage3_param_persistence_threshold": ("10 × hidden_size", lambda h: 10 * h),
}


def _settle(data: MutableMapping[str, Any], path: str, facts: Facts) -> Note:
    """Set (or drop, for the default) the pending `auto` at `path`."""
    section, _, name = path.partition(".params.")
    if path in _DTYPES:
        params = facts.model.parameters() if facts.model is not None else ()
        dtype = next((p.dtype for p in params if p.is_floating_point()), None)
        return _set(data, path, dtype == _DTYPES[path], "the model's dtype")
    if path in _BUCKETS:
        formula, compute = _BUCKETS[path]
        size = hidden_size(facts.model)
        if size is None:
            return _drop(data, path, "the default (the model's config gives no hidden size)")
        return _set(data, path, compute(size), f"{formula}, hidden_size {size}")
    if section == "optimizer":
        spec = OPTIMIZERS.get(data["optimizer"]["type"])
        default = spec.torch_arguments().get(name) if spec is not None else None
        return _drop(data, path, f"{json.dumps(default)} (torch's default)")
    if name == "total_num_steps":
        return _set(data, path, _total_steps(facts, path), "the trainer's total steps")
    if name == "warmup_max_lr":
        return _set(data, path, _optimizer_lr(data, facts), "the optimizer's lr")
    if name in ("warmup_min_lr", "warmup_num_steps"):
        return _set(data, path, 0 if name == "warmup_num_steps" else 0.0, "Hugging Face's choice")
    default = SCHEDULES.get(data["scheduler"]["type"], {}).get(name)
    return _drop(data, path, f"{json.dumps(default)} (the schedule's default)")


def parent(data: MutableMapping[str, Any], path: str) -> tuple[MutableMapping[str, Any], str]:
    """The mapping that holds the dotted `path` in `data`, and the last key."""
    *parents, key = path.split(".")
    node = data
    for part in parents:
        node = node[part]
    return node, key


def _set(data: MutableMapping[str, Any], path: str, value: Any, why: str) -> Note:
    node, key = parent(data, path)
    node[key] = value
    return Note(path, f"`{path}: auto` became {json.dumps(value)} ({why})")


def _drop(data: MutableMapping[str, Any], path: str, why: str) -> Note:
    node, key = parent(data, path)
    del node[key]
    return Note(path, f"`{path}: auto` became {why}")


def _total_steps(facts: Facts, path: str) -> int:
    if facts.total_num_steps is None:
        raise ConfigError(
            f"`{path}` is `auto`, and only a trainer knows the total number of optimizer steps: set it to a number, "
            "pass `total_num_steps=` to `Config.resolve`, or pass your own `lr_scheduler` with every scheduler "
            "param `auto`")
    return int(facts.total_num_steps)


def _optimizer_lr(data: Mapping[str, Any], facts: Facts) -> float | list[float]:
    """The lr the optimizer starts from: the config's, the passed optimizer's, else torch's default."""
    section = data.get("optimizer")
    if isinstance(section, Mapping) and "lr" in section.get("params", {}):
        return float(section["params"]["lr"])
    groups = getattr(facts.optimizer, "param_groups", None)
    if groups:
        lrs = [float(g["lr"]) for g in groups]
        return lrs[0] if len(set(lrs)) == 1 else lrs
    if isinstance(section, Mapping) and section.get("type") in OPTIMIZERS:
        return float(OPTIMIZERS[section["type"]].default("lr"))
    return float(SCHEDULES["WarmupLR"]["warmup_max_lr"])


def hidden_size(model: nn.Module | None) -> int | None:
    """The model's hidden size as transformers reads it (`config.hidden_size`, largest of `hidden_sizes`,
    or the same under `config.text_config`), or None."""
    config = getattr(model, "config", None)
    for holder in (config, getattr(config, "text_config", None)):
        if holder is None:
            continue
        size = getattr(holder, "hidden_size", None)
        if isinstance(size, int):
            return size
        sizes = getattr(holder, "hidden_sizes", None)
        if isinstance(sizes, (list, tuple)) and sizes:
            return int(max(sizes))
    return None
