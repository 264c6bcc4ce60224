"""The learning-rate schedules a config `scheduler` section can name, and their argument checks.

This module only describes (names, arguments, defaults, valid ranges): `shardwise.optim.schedulers`
implements the schedules and validates against the same description, so the config and the
constructors reject the same values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["DEEPSPEED_ONLY_SCHEDULES", "REQUIRED", "SCHEDULES", "WARMUP_TYPES", "is_number", "param_problems"]

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


def _lr_ok(value: Any) -> bool:
    values = value if isinstance(value, (list, tuple)) else [value]
    return bool(values) and all(is_number(v) and v >= 0 for v in values)


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
        if name in params and not _lr_ok(params[name]):
            bad(name, "a number >= 0, or a list of them with one per param group")
    for name in ("warmup_min_ratio", "cos_min_ratio"):
        value = params.get(name, 0.0)
        if not (is_number(value) and 0 <= value <= 1):
            bad(name, "a number in [0, 1]")
    iteration = params.get("last_batch_iteration", -1)
    if not (_is_int(iteration) and iteration >= -1):
        bad("last_batch_iteration", "an integer >= -1")
    return problems
