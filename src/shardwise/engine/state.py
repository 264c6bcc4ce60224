"""The engine as the checkpoint layer sees it (:class:`~shardwise.checkpoint.protocol.Checkpointable`).

``Engine.checkpointable()`` returns an :class:`EngineState`: the engine's pieces (strategy, optimizer,
scheduler, precision, counters) behind the protocol, so ``shardwise.checkpoint`` knows no stage and no engine
attribute.  The counters are a small ``Stateful`` that accepts only its three keys, as non-negative integers.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch
from torch import nn

from ..comm.distributed import Comm
from ..optim.param_state import ParamShard

if TYPE_CHECKING:
    from ..checkpoint.protocol import Apply, Stateful

__all__ = ["Counters", "EngineParts", "EngineState"]

COUNTERS = ("global_steps", "micro_steps", "skipped_steps")


class EngineParts(Protocol):
    """What of an engine its checkpoint view reads: the engine's attributes, named here so that this module
    needs no import of :class:`~.engine.Engine` (which builds the view)."""

    comm: Comm
    name: Optional[str]
    config: Any
    strategy: Any
    precision: Any
    module: nn.Module
    optimizer: Any
    lr_scheduler: Any
    global_steps: int
    micro_steps: int
    skipped_steps: int

    def state_dict_16bit(self) -> dict[str, torch.Tensor]: ...


class Counters:
    """The engine's step counters as a ``Stateful``."""

    def __init__(self, engine: EngineParts) -> None:
        self._engine = engine

    def state_dict(self) -> dict[str, Any]:
        return {name: int(getattr(self._engine, name)) for name in COUNTERS}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, value in check_counters(state_dict).items():
            setattr(self._engine, name, value)


def check_counters(state: Any) -> dict[str, int]:
    """``state`` if it holds exactly the counters, as non-negative integers; else ValueError naming the field."""
    if not isinstance(state, dict) or set(state) != set(COUNTERS):
        keys = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"counters: expected exactly the keys {list(COUNTERS)}, got {keys}")
    for name, value in state.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"counters[{name!r}]: expected a non-negative integer, got {value!r}")
    return dict(state)


class _OptimizerInfo:
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    @property
    def class_name(self) -> str:
        return type(self._inner).__name__

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        groups: list[dict[str, Any]] = self._inner.param_groups
        return groups


class EngineState:
    """One engine behind the checkpoint protocol (see the module docstring)."""

    def __init__(self, engine: EngineParts) -> None:
        self._engine = engine
        self._strategy = engine.strategy

    @property
    def comm(self) -> Comm:
        return self._engine.comm

    @property
    def name(self) -> Optional[str]:
        return self._engine.name

    @property
    def settings(self) -> Any:
        return self._engine.config.checkpoint

    @property
    def stage(self) -> int:
        return self._strategy.stage

    @property
    def dtype(self) -> torch.dtype:
        return self._engine.precision.dtype

    @property
    def module(self) -> nn.Module:
        return self._engine.module

    @property
    def global_steps(self) -> int:
        return self._engine.global_steps

    @property
    def optimizer(self) -> Optional[_OptimizerInfo]:
        optimizer = self._engine.optimizer
        return _OptimizerInfo(optimizer.inner) if optimizer is not None else None

    def shards(self, loading: bool, wanted: frozenset[str] = frozenset()) -> contextlib.AbstractContextManager[list[ParamShard]]:
        return self._strategy.checkpoint_shards(loading, wanted)

    def group_names(self) -> list[list[str]]:
        return self._strategy.group_names()

    def save_entries(self, live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self._strategy.save_entries(live)

    def load_entries(self, live: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], "Apply"]:
        return self._strategy.load_entries(live)

    def writable_full_params(self) -> contextlib.AbstractContextManager[None]:
        return self._strategy.writable_full_params()

    def extras(self) -> dict[str, "Stateful"]:
        found: dict[str, Stateful] = {"precision": self._engine.precision, "counters": Counters(self._engine)}
        if self._engine.lr_scheduler is not None:
            found["scheduler"] = self._engine.lr_scheduler
        return found

    def weights_16bit(self) -> Optional[dict[str, torch.Tensor]]:
        if not self._engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
            return None
        return self._engine.state_dict_16bit()

    def after_load(self) -> None:
        self._strategy.sync_params_from_master()
