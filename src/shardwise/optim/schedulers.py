"""DeepSpeed's warmup learning-rate schedules: WarmupLR, WarmupDecayLR, WarmupCosineLR.

Same parameter names and formulas as DeepSpeed (`deepspeed/runtime/lr_schedules.py`). With `n` the
iteration (`last_batch_iteration`) and `W` = `warmup_num_steps`, the warmup fraction is

    log:    log(n + 1) / log(W)   for n < W, then 1
    linear: n / W                 for n < W, then 1

and the schedules are

    WarmupLR:       min_lr + (max_lr - min_lr) * warmup_fraction
    WarmupDecayLR:  as WarmupLR during warmup, then min_lr + (max_lr - min_lr) * max(0, (T - n) / (T - W))
    WarmupCosineLR: initial_lr * ratio, ratio rising from warmup_min_ratio to 1 during warmup, then
                    cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * (n - W + 1) / (T - W))) / 2

where `T` = `total_num_steps`. Iteration -1 is "not started": `warmup_min_lr` (WarmupCosineLR: 0 in
every group), as DeepSpeed's `get_lr` before its first step.

Where the schedule starts is `deepspeed_start` (docs/from-deepspeed.md, the dialect table): False follows torch
(construction writes iteration `last_batch_iteration + 1`'s lr, so step `k` runs at iteration `k`), True DeepSpeed 0.19
(construction writes iteration `last_batch_iteration`'s lr, so step `k` runs at `k - 1`).  A loaded state with
`last_batch_iteration: n` writes iteration `n`'s lr either way.

On purpose unlike DeepSpeed: `warmup_num_steps` 0 means no warmup and 1 one step at the minimum (DeepSpeed
silently raises it to 2), and bad arguments raise ValueError instead of a logged warning.  The classes subclass
`torch.optim.lr_scheduler.LRScheduler` without running its constructor (which insists on a
`torch.optim.Optimizer` and patches `step`): any object with a `param_groups` list of dicts works.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from shardwise.config import Config, SchedulerConfig

# The argument checks live with the description, so the config and the constructors reject the
# same values.
from shardwise.config.registry import param_problems

__all__ = ["SCHEDULERS", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "build_scheduler", "param_problems"]


def _raise_on_problems(owner: str, params: Mapping[str, Any]) -> None:
    problems = param_problems(params)
    if problems:
        raise ValueError("\n".join(f"{owner}: `{name}` {problem}" for name, problem in problems))


def _param_groups(optimizer: Any) -> list[dict[str, Any]]:
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) and "lr" in g for g in groups):
        raise TypeError(
            f"{type(optimizer).__name__} has no usable `param_groups`: expected a non-empty list of dicts, "
            "each with an 'lr'; pass a torch optimizer or a wrapper that exposes its `param_groups`"
        )
    return groups


def _per_group(value: float | Sequence[float], count: int, name: str) -> list[float]:
    """One float per param group from a single value or a list of them."""
    if isinstance(value, (int, float)):
        return [float(value)] * count
    if len(value) != count:
        raise ValueError(
            f"`{name}` has {len(value)} values but the optimizer has {count} param groups; "
            "give one value per group or a single number"
        )
    return [float(v) for v in value]


def _warmup_fraction(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """How far warmup has got at `iteration`: 0 at the start, 1 once warm."""
    if iteration >= warmup_num_steps:
        return 1.0
    if warmup_type == "linear":
        return iteration / warmup_num_steps
    # DeepSpeed's log curve reaches 1 on the last warmup step; one step of warmup stays at the start.
    return math.log(iteration + 1) / math.log(warmup_num_steps) if warmup_num_steps > 1 else 0.0


class _WarmupSchedule(LRScheduler):
    """Shared stepping and state for the closed-form schedules below; subclasses define `_lrs_at`."""

    def __init__(self, optimizer: Any, warmup_num_steps: int, warmup_type: str, last_batch_iteration: int,
                 deepspeed_start: bool) -> None:
        # LRScheduler.__init__ is skipped on purpose (see the module docstring).
        groups = _param_groups(optimizer)
        self.optimizer, self.warmup_num_steps, self.warmup_type = optimizer, warmup_num_steps, warmup_type
        # torch's convention: `initial_lr` survives optimizer checkpoints, so a resumed schedule
        # measures against the original lr rather than an already-scheduled one.
        base_lrs: list[float | torch.Tensor] = [float(g.setdefault("initial_lr", g["lr"])) for g in groups]
        self.base_lrs = base_lrs
        self.deepspeed_start, self.last_batch_iteration, self._last_lr = deepspeed_start, last_batch_iteration, []
        # DeepSpeed's constructor writes the current iteration's lr without stepping; torch's steps once.
        self.step(last_batch_iteration if deepspeed_start else None)

    @property  # type: ignore[override]
    def last_epoch(self) -> int:
        """torch's name for `last_batch_iteration`."""
        return self.last_batch_iteration

    @last_epoch.setter
    def last_epoch(self, value: int) -> None:
        self.last_batch_iteration = value

    def _lrs_at(self, iteration: int) -> list[float]:
        raise NotImplementedError

    def _lrs_before_start(self) -> list[float]:
        raise NotImplementedError

    def _lrs(self, iteration: int) -> list[float]:
        return self._lrs_before_start() if iteration < 0 else self._lrs_at(iteration)

    def get_lr(self) -> list[float | torch.Tensor]:
        """The learning rates, one per param group, for the current iteration."""
        return [*self._lrs(self.last_batch_iteration)]

    def get_last_lr(self) -> list[float | torch.Tensor]:
        """The learning rates this schedule last wrote into the param groups."""
        return [*self._last_lr]

    def step(self, last_batch_iteration: int | None = None) -> None:  # type: ignore[override]
        """Advance one iteration (or jump to `last_batch_iteration`) and write the lrs into the groups."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply(self._lrs(self.last_batch_iteration))

    def _apply(self, lrs: list[float]) -> None:
        groups = self.optimizer.param_groups
        if len(groups) != len(lrs):
            raise RuntimeError(
                f"{type(self).__name__} was built for {len(lrs)} param groups but the optimizer now has "
                f"{len(groups)}; build the scheduler after the last `add_param_group`"
            )
        for group, lr in zip(groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)  # keep a tensor lr a tensor (capturable / compiled optimizers)
            else:
                group["lr"] = lr
        self._last_lr = [*lrs]

    def state_dict(self) -> dict[str, Any]:
        """The iteration and base lrs; arguments come from the config, as in DeepSpeed."""
        return {"last_batch_iteration": self.last_batch_iteration, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (or DeepSpeed's `{'last_batch_iteration': n}`) and write its lrs."""
        if "last_batch_iteration" not in state_dict:
            raise KeyError(
                f"{type(self).__name__}.load_state_dict: no 'last_batch_iteration' in keys {sorted(state_dict)}; "
                "pass a dict from `state_dict()`"
            )
        base_lrs = state_dict.get("base_lrs", self.base_lrs)
        if len(base_lrs) != len(self.base_lrs):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: state has {len(base_lrs)} param groups, the optimizer "
                f"has {len(self.base_lrs)}; load a checkpoint made with the same param groups"
            )
        restored: list[float | torch.Tensor] = [float(lr) for lr in base_lrs]
        self.base_lrs = restored
        self.step(int(state_dict["last_batch_iteration"]))


class WarmupLR(_WarmupSchedule):
    """Warm each group's lr up from `warmup_min_lr` to `warmup_max_lr` over `warmup_num_steps`, then hold.

    `warmup_min_lr` / `warmup_max_lr` are a number or a list with one value per param group;
    `warmup_type` is `"log"` or `"linear"`.
    """

    def __init__(self, optimizer: Any, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1, *, deepspeed_start: bool = False) -> None:
        _raise_on_problems(type(self).__name__, self._arguments(locals()))
        count = len(_param_groups(optimizer))
        self.min_lrs = _per_group(warmup_min_lr, count, "warmup_min_lr")
        self.max_lrs = _per_group(warmup_max_lr, count, "warmup_max_lr")
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration, deepspeed_start)

    @staticmethod
    def _arguments(scope: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in scope.items() if k not in ("self", "optimizer", "__class__", "deepspeed_start")}

    def _gamma(self, iteration: int) -> float:
        return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)

    def _lrs_at(self, iteration: int) -> list[float]:
        gamma = self._gamma(iteration)
        return [low + (high - low) * gamma for low, high in zip(self.min_lrs, self.max_lrs)]

    def _lrs_before_start(self) -> list[float]:
        return [*self.min_lrs]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then decay linearly from `warmup_max_lr` to `warmup_min_lr` at `total_num_steps`."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1, *, deepspeed_start: bool = False) -> None:
        _raise_on_problems(type(self).__name__, self._arguments(locals()))
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration,
                         deepspeed_start=deepspeed_start)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return super()._gamma(iteration)
        return max(0.0, (self.total_num_steps - iteration) / (self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_WarmupSchedule):
    """Scale each group's initial lr: warm the ratio up from `warmup_min_ratio` to 1, then follow a
    cosine down to `cos_min_ratio` at `total_num_steps` (and stay there)."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1, *, deepspeed_start: bool = False) -> None:
        _raise_on_problems(type(self).__name__, WarmupLR._arguments(locals()))
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio, self.cos_min_ratio = float(warmup_min_ratio), float(cos_min_ratio)
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration, deepspeed_start)

    def _ratio(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            fraction = _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * fraction
        span = self.total_num_steps - self.warmup_num_steps
        done = min(iteration - self.warmup_num_steps + 1, span)
        return self.cos_min_ratio + (1.0 - self.cos_min_ratio) * (1.0 + math.cos(math.pi * done / span)) / 2.0

    def _lrs_at(self, iteration: int) -> list[float]:
        ratio = self._ratio(iteration)
        return [float(base) * ratio for base in self.base_lrs]

    def _lrs_before_start(self) -> list[float]:
        # DeepSpeed 0.19 writes 0 into every group, not `warmup_min_ratio` x lr.
        return [0.0] * len(self.base_lrs)


SCHEDULERS: dict[str, type[_WarmupSchedule]] = {
    "WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
}


def build_scheduler(config: SchedulerConfig | Mapping[str, Any], optimizer: Any) -> _WarmupSchedule:
    """Build the schedule a `scheduler` config section describes (a SchedulerConfig or its dict)."""
    if not isinstance(config, SchedulerConfig):
        # Validate through Config so errors carry `scheduler.` paths like any other config problem.
        section = Config.load({"scheduler": dict(config)}).scheduler
        if section is None:  # cannot happen: the key was just given
            raise ValueError("build_scheduler: no `scheduler` section to build")
        config = section
    if config.type not in SCHEDULERS:
        raise ValueError(f"scheduler type `{config.type}` has a description but no implementation")
    return SCHEDULERS[config.type](optimizer, **config.params, deepspeed_start=config.deepspeed_start)
