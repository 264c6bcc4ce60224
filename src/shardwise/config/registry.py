"""The one registry of what a config can name: the torch optimizer each `optimizer.type` builds, and the
learning-rate schedules a `scheduler` section can name, with their arguments and checks.

It only describes: `shardwise.optim.optimizers.build_optimizer` and `shardwise.optim.schedulers` build from it, and the
config sections validate against the same description, so the config and the constructors reject the same values. Every
optimizer here updates each element from its own gradient and state, which is what lets ZeRO shard it piece by piece
(see docs/zero.md); whole-tensor optimizers (LAMB, Adafactor, Muon) do not fit.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["DEEPSPEED_ONLY_OPTIMIZERS", "DEEPSPEED_ONLY_SCHEDULES", "OPTIMIZERS", "REQUIRED", "SCHEDULES",
           "WARMUP_TYPES", "OptimizerSpec", "is_number", "param_problems"]


@dataclass(frozen=True)
class OptimizerSpec:
    """One `optimizer.type`: the torch class it builds and DeepSpeed's extra arguments it accepts."""

    torch_class: type[torch.optim.Optimizer]
    # DeepSpeed arguments that are not torch's: name -> what it means here.
    extras: Mapping[str, str] = field(default_factory=dict)

    def torch_arguments(self) -> dict[str, Any]:
        """torch's keyword arguments (name -> default) for this optimizer, `params` excluded."""
        signature = inspect.signature(self.torch_class).parameters
        return {n: p.default for n, p in signature.items() if n != "params"}

    def known_arguments(self) -> list[str]:
        return [*self.torch_arguments(), *self.extras]

    def build_with(self, params: Mapping[str, Any]) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
        """The torch class and keyword arguments a validated `params` mapping stands for."""
        kwargs = {k: v for k, v in params.items() if k not in self.extras}
        cls = self.torch_class
        # DeepSpeed's `type: Adam` is decoupled weight decay (AdamW) unless `adam_w_mode: false`.
        if cls is torch.optim.Adam and params.get("adam_w_mode", True):
            cls = torch.optim.AdamW
        if "betas" in kwargs:
            kwargs["betas"] = tuple(kwargs["betas"])
        return cls, kwargs

    def default(self, name: str) -> Any:
        """torch's default for argument `name` (e.g. `lr`)."""
        return self.torch_arguments()[name]


_ADAM_EXTRAS = {
    "adam_w_mode": "true (DeepSpeed's default): `Adam` means decoupled weight decay, i.e. torch's AdamW",
    "torch_adam": "accepted; shardwise always uses torch's implementation",
    "bias_correction": "true (DeepSpeed's default): torch's Adam always corrects the moments' bias; false is refused",
}

#: DeepSpeed's names (any case in a config) -> spec. DeepSpeed accepts any `torch.optim` name;
#: these are the element-wise ones.
OPTIMIZERS: dict[str, OptimizerSpec] = {
    "Adam": OptimizerSpec(torch.optim.Adam, _ADAM_EXTRAS),
    "AdamW": OptimizerSpec(torch.optim.AdamW, _ADAM_EXTRAS),
    "SGD": OptimizerSpec(torch.optim.SGD),
    "Adagrad": OptimizerSpec(torch.optim.Adagrad),
    "RMSprop": OptimizerSpec(torch.optim.RMSprop),
    "Adamax": OptimizerSpec(torch.optim.Adamax),
    "NAdam": OptimizerSpec(torch.optim.NAdam),
    "RAdam": OptimizerSpec(torch.optim.RAdam),
    "Adadelta": OptimizerSpec(torch.optim.Adadelta),
}

#: DeepSpeed's own optimizers (its `optimizer.type` names) that shardwise does not provide.
DEEPSPEED_ONLY_OPTIMIZERS = {
    "Lamb": "LAMB (a whole-tensor trust ratio, which piecewise ZeRO sharding cannot compute)",
    "OneBitAdam": "1-bit Adam (compressed communication)",
    "ZeroOneAdam": "0/1 Adam (compressed communication)",
    "OneBitLamb": "1-bit LAMB (compressed communication)",
    "Lion": "Lion (DeepSpeed's fused kernel)",
    "MuAdam": "MuAdam (muP scaling)",
    "MuAdamW": "MuAdamW (muP scaling)",
    "MuSGD": "MuSGD (muP scaling)",
    "Muon": "Muon (whole-matrix orthogonalisation, which piecewise ZeRO sharding cannot compute)",
}


# ---- learning-rate schedules

WARMUP_TYPES = ("log", "linear")


class _Required:
    """Marks an argument without a default."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()

_WARMUP = {"warmup_num_steps": 1000, "warmup_type": "log", "last_batch_iteration": -1}
_LRS = {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001}

#: name -> argument -> default (REQUIRED when there is none), in DeepSpeed's spelling.
SCHEDULES: dict[str, dict[str, Any]] = {
    "WarmupLR": {**_LRS, **_WARMUP},
    "WarmupDecayLR": {"total_num_steps": REQUIRED, **_LRS, **_WARMUP},
    "WarmupCosineLR": {
        "total_num_steps": REQUIRED, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
        "cos_min_ratio": 0.0001, "warmup_type": "log", "last_batch_iteration": -1,
    },
}

#: DeepSpeed's schedules that shardwise does not implement.
DEEPSPEED_ONLY_SCHEDULES = {
    "OneCycle": "DeepSpeed's OneCycle schedule (torch.optim.lr_scheduler.OneCycleLR is close)",
    "LRRangeTest": "DeepSpeed's LR range test",
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def param_problems(params: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Check schedule arguments (any subset of the known names); return `(name, problem)` pairs."""
    problems: list[tuple[str, str]] = []

    def bad(name: str, expected: str) -> None:
        problems.append((name, f"got {params[name]!r}; expected {expected}"))

    warmup = params.get("warmup_num_steps", 0)
    warmup_ok = _is_int(warmup) and warmup >= 0
    if "warmup_num_steps" in params and not warmup_ok:
        bad("warmup_num_steps", "an integer >= 0")
    total = params.get("total_num_steps")
    if "total_num_steps" in params and not (_is_int(total) and (not warmup_ok or total > warmup)):
        bad("total_num_steps", f"an integer > warmup_num_steps ({warmup}); raise it or lower warmup_num_steps")
    if params.get("warmup_type", "log") not in WARMUP_TYPES:
        bad("warmup_type", "'log' or 'linear'")
    for name in ("warmup_min_lr", "warmup_max_lr"):
        value = params.get(name, 0.0)
        values = value if isinstance(value, (list, tuple)) else [value]
        if not (values and all(is_number(v) and v >= 0 for v in values)):
            bad(name, "a number >= 0, or a list of them with one per param group")
    for name in ("warmup_min_ratio", "cos_min_ratio"):
        value = params.get(name, 0.0)
        if not (is_number(value) and 0 <= value <= 1):
            bad(name, "a number in [0, 1]")
    iteration = params.get("last_batch_iteration", -1)
    if not (_is_int(iteration) and iteration >= -1):
        bad("last_batch_iteration", "an integer >= -1")
    return problems
