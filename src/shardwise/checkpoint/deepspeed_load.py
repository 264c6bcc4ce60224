"""``load_checkpoint`` of a DeepSpeed checkpoint directory into a shardwise engine (any stage, world size).

Every rank reads the whole checkpoint (:func:`read_deepspeed`), bounded by and checked against this engine's model, then
takes its own pieces.  As in ``load.py``, everything is checked on every rank before anything is changed, and a failure
on one rank is raised on all.  At stage 0 DeepSpeed saves the torch optimizer's ``state_dict``, which numbers the
parameters by position in the param groups: it is matched position by position with this engine's optimizer, every shape
checked; two parameters of one shape are never told apart by guessing.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from ..comm.agreement import Session
from ..optim.param_state import ParamShard
from .deepspeed_format import DeepSpeedCheckpoint, DeepSpeedParam, ModelShapes, read_deepspeed
from .files import CheckpointError
from .protocol import Checkpointable

__all__ = ["load_deepspeed"]

def load_deepspeed(engine: Checkpointable, session: Session, path: Path, options: Any) -> tuple[str, dict[str, Any]]:
    """Restore ``engine`` from DeepSpeed tag directory ``path``; ``options`` as ``load.py``'s ``_Options``."""
    allow = engine.settings.allow_pickle
    with engine.shards(loading=True) as shards:
        with torch._C.DisableTorchFunctionSubclass():  # a partitioned parameter reports its full shape
            shapes = {name: t.shape for name, t in engine.module.state_dict(keep_vars=True).items()}
        model = ModelShapes({**shapes, **{shard.name: shard.shape for shard in shards}})
        ckpt, _ = session.step("reading the DeepSpeed checkpoint", lambda: read_deepspeed(path, allow, model))
        plan, _ = session.step("checking it against this engine", lambda: _Plan(engine, ckpt, shards, options))
        plan.apply()
    engine.after_load()
    return str(path), ckpt.client_state


class _Plan:
    """What one rank will write, all of it checked first."""

    def __init__(self, engine: Checkpointable, ckpt: DeepSpeedCheckpoint, shards: list[ParamShard], options: Any) -> None:
        self.engine, self.ckpt, self.shards, self.options = engine, ckpt, shards, options
        self.rank = engine.comm.rank
        if options.module_load_fn is not None:
            raise CheckpointError(
                f"rank {self.rank}: `module_load_fn` is not supported for the DeepSpeed checkpoint {ckpt.path}; get "
                "its weights with `shardwise checkpoint consolidate DIR --out FILE` and load those yourself"
            )
        self.params = _by_name(ckpt, engine, shards, self.rank, options.optimizer)
        for shard in self.shards:
            found = self.params.get(shard.name)
            if found is None or found.value is None and shard.name not in self.ckpt.module:
                raise CheckpointError(
                    f"rank {self.rank}: parameter `{shard.name}` is not in the DeepSpeed checkpoint {self.ckpt.path} "
                    f"(it has {sorted(self.params)}); build the same model, or load the weights yourself with "
                    "`module_load_fn=`"
                )
            if found.shape is not None and tuple(found.shape) != tuple(shard.shape):
                raise CheckpointError(
                    f"rank {self.rank}: `{shard.name}` is {tuple(found.shape)} in the DeepSpeed checkpoint "
                    f"{self.ckpt.path} and {tuple(shard.shape)} here; build the same model"
                )
        if self.options.optimizer and self.engine.optimizer is not None and self.ckpt.hyper:
            current = len(self.engine.optimizer.param_groups)
            if len(self.ckpt.hyper) != current:
                raise CheckpointError(
                    f"rank {self.rank}: the DeepSpeed optimizer has {len(self.ckpt.hyper)} param group(s), this one "
                    f"{current}; build the optimizer with the same param groups, or pass `load_optimizer_states=False`"
                )
        self.entries = self._entries()
        self.extras = self._extras()

    def _entries(self) -> list[str]:
        """Module entries without a master here (buffers, frozen parameters) that the checkpoint has."""
        with_master = {s.name for s in self.shards}
        live = dict(self.engine.module.state_dict(keep_vars=True))
        missing = [n for n in live if n not in with_master and n not in self.ckpt.module]
        if missing and self.options.strict:
            raise CheckpointError(
                f"rank {self.rank}: the DeepSpeed checkpoint {self.ckpt.path} has no values for {missing}; "
                "pass `strict=False` to keep this model's values for them"
            )
        return [n for n in live if n not in with_master and n in self.ckpt.module and self.ckpt.module[n].numel() > 0]

    def _extras(self) -> dict[str, dict[str, Any]]:
        if self.options.module_only:
            return {}
        extras = self.engine.extras()
        # DeepSpeed saves no micro-step count; at a save (an accumulation boundary) it is steps x accumulation
        steps = self.ckpt.counters["global_steps"]
        counters = {"global_steps": steps, "skipped_steps": self.ckpt.counters["skipped_steps"],
                    "micro_steps": steps * self.ckpt.accumulation}
        found: dict[str, dict[str, Any]] = {"counters": counters}
        if self.options.scheduler and self.ckpt.scheduler is not None:
            if "scheduler" in extras:
                found["scheduler"] = dict(self.ckpt.scheduler)
            else:
                warnings.warn(f"DeepSpeed checkpoint {self.ckpt.path} has lr scheduler state but this engine has "
                              "no scheduler", stacklevel=5)
        precision = self._precision(extras["precision"].state_dict())
        if precision is not None:
            found["precision"] = precision
        return found

    def _precision(self, current: dict[str, Any]) -> Optional[dict[str, Any]]:
        saved = self.ckpt.scaler
        if self.ckpt.dtype != "fp16" or current["dtype"] != "float16" or not saved:
            if (self.ckpt.dtype == "fp16") != (current["dtype"] == "float16"):
                warnings.warn(f"DeepSpeed checkpoint {self.ckpt.path} was trained in {self.ckpt.dtype}, this engine "
                              f"runs in {current['dtype']}: the loss scaler starts fresh", stacklevel=6)
            return None
        scaler = dict(current["scaler"])
        for mine, theirs, kind in (("scale", "cur_scale", float), ("iteration", "cur_iter", int),
                                   ("last_overflow", "last_overflow_iter", int), ("credit", "cur_hysteresis", int)):
            value = saved.get(theirs, scaler[mine])
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise CheckpointError(f"rank {self.rank}: the DeepSpeed loss scaler's `{theirs}` is {value!r}, "
                                      "expected a number; the checkpoint was damaged")
            scaler[mine] = kind(value)
        return {**current, "scaler": scaler}

    def apply(self) -> None:
        live = dict(self.engine.module.state_dict(keep_vars=True))
        buffers, apply_entries = self.engine.load_entries({n: live[n] for n in self.entries})
        for name, buffer in buffers.items():
            buffer.copy_(self.ckpt.module[name].reshape(buffer.shape))
        apply_entries()  # collective where the stage partitions them: every rank calls it
        for shard in self.shards:
            param = self.params[shard.name]
            value = param.value if param.value is not None else self.ckpt.module[shard.name].float()
            shard.master.reshape(-1).copy_(value.reshape(-1)[shard.start : shard.end])
            if self.options.optimizer and param.state:
                shard.state.set({k: (v.reshape(-1)[shard.start : shard.end].clone().to(shard.master.device)
                                     if isinstance(v, torch.Tensor) and v.dim() > 0 else
                                     (v.clone() if isinstance(v, torch.Tensor) else v)) for k, v in param.state.items()})
        if self.options.optimizer and self.engine.optimizer is not None:
            for group, saved in zip(self.engine.optimizer.param_groups, self.ckpt.hyper):
                group.update({k: v for k, v in saved.items() if k in group and k != "params"})
        extras = self.engine.extras()
        for name, state in self.extras.items():
            extras[name].load_state_dict(state)


def _by_name(ckpt: DeepSpeedCheckpoint, engine: Checkpointable, shards: list[ParamShard], rank: int,
             optimizer: bool) -> dict[str, DeepSpeedParam]:
    """The checkpoint's parameters by name; at stage 0 (saved by position) matched with this engine's groups."""
    named = {p.name: p for group in ckpt.groups for p in group if p.name is not None}
    if named or not ckpt.groups:
        return named
    if not optimizer:  # without its optimizer state, stage 0's weights are the module's, by name
        return {s.name: DeepSpeedParam(s.name, None, None, {}) for s in shards}
    return _match_stage0(ckpt, engine.group_names(), {s.name: tuple(s.shape) for s in shards}, rank)


def _match_stage0(ckpt: DeepSpeedCheckpoint, order: list[list[str]], shapes: dict[str, tuple[int, ...]],
                  rank: int) -> dict[str, DeepSpeedParam]:
    """Position ``j`` of param group ``g`` in the checkpoint is the ``j``-th parameter this engine's optimizer
    lists in group ``g``: the same rule torch's ``Optimizer.load_state_dict`` follows."""
    saved_sizes, sizes = [len(g) for g in ckpt.groups], [len(g) for g in order]
    if saved_sizes != sizes:
        raise CheckpointError(
            f"rank {rank}: the DeepSpeed checkpoint {ckpt.path} holds optimizer state for param groups of "
            f"{saved_sizes} parameter(s), this engine's optimizer has groups of {sizes}; at ZeRO stage 0 DeepSpeed "
            "saves that state by position only, so it is matched position by position: build the optimizer with "
            "the same param groups, listing the same parameters in the same order, as the DeepSpeed run, or pass "
            "`load_optimizer_states=False`"
        )
    matched: dict[str, DeepSpeedParam] = {}
    for g, (names, saved) in enumerate(zip(order, ckpt.groups)):
        for j, (name, param) in enumerate(zip(names, saved)):
            want = shapes.get(name)  # None: frozen here (no master), nothing of it is loaded
            if param.shape is not None and want is not None and tuple(param.shape) != want:
                raise CheckpointError(
                    f"rank {rank}: parameter {j} of param group {g} has state of shape {tuple(param.shape)} in the "
                    f"DeepSpeed checkpoint {ckpt.path}, and this engine's optimizer lists `{name}` there, which is "
                    f"{want}; at ZeRO stage 0 the state is matched by position: list the parameters in the order "
                    "the DeepSpeed run's optimizer did, or pass `load_optimizer_states=False`"
                )
            matched[name] = DeepSpeedParam(name, param.shape, param.value, param.state)
    return matched
