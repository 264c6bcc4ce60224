"""A stage's ZeRO strategy as the optimizer must see it in a pipeline: each tied weight counted once.

A tied weight has a copy on every stage that holds its key, each with the
same (summed) gradient.  The global gradient norm (clipping, overflow) is the
sum of every stage's squared norm, so the copies whose first holder is
another stage are taken out of this stage's ``step_sums``.  Everything else is
the stage's own strategy (stage 0 or 1 over the data-parallel group).
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

from ..param_state import OptimizerSlot, ParamShard
from ..zero.base import Strategy

__all__ = ["PipelineStrategy"]


class PipelineStrategy(Strategy):
    """Delegates to ``wrapped``, except that ``step_sums`` leaves out the tied ``copies``."""

    def __init__(self, wrapped: Strategy, copies: frozenset[str]) -> None:
        # Strategy.__init__ is not called: every other attribute resolves on `wrapped` (__getattr__);
        # these three are class attributes of Strategy, which would shadow it.
        self.wrapped = wrapped
        self.stage = wrapped.stage
        self.shards_grads = wrapped.shards_grads
        self.loss_divisor = wrapped.loss_divisor
        self.copies = copies

    def __getattr__(self, name: str) -> Any:
        if name == "wrapped":
            raise AttributeError(name)
        return getattr(self.wrapped, name)

    def step_sums(self) -> torch.Tensor:
        total = self.wrapped.step_sums()
        if not self.copies:
            return total
        # The inner optimizer steps each piece's key with key.grad: the reduced gradient of that piece.
        with self.wrapped.checkpoint_shards(loading=False) as shards:
            keys = [key for key in (_copy_key(s, self.copies) for s in shards) if key is not None]
        for grad in {id(key): key.grad for key in keys}.values():
            if grad is not None:
                flat = grad.reshape(-1).float()
                total[0] -= torch.dot(flat, flat)  # (element 0: the norm's share; a fresh tensor)
        return total

    # ------------------------------------------------------------ delegated
    def attach(self, inner: Optional[Any], initial: Optional[dict[int, torch.Tensor]] = None) -> None:
        self.wrapped.attach(inner, initial)

    def start_backward(self, sync: bool) -> None:
        self.wrapped.start_backward(sync)

    def finish_backward(self) -> None:
        self.wrapped.finish_backward()

    def step(self, inner: Any, factor: float, sums: torch.Tensor, release: bool) -> None:
        self.wrapped.step(inner, factor, sums, release)

    def sync_params_from_master(self) -> None:
        self.wrapped.sync_params_from_master()

    def adding_to_reduced(self) -> contextlib.AbstractContextManager[None]:
        return self.wrapped.adding_to_reduced()

    def zero_grad(self) -> None:
        self.wrapped.zero_grad()

    def memory_breakdown(self) -> dict[str, int]:
        return self.wrapped.memory_breakdown()

    def full_master_weights(self) -> dict[int, torch.Tensor]:
        return self.wrapped.full_master_weights()

    def checkpoint_shards(
        self, loading: bool, wanted: frozenset[str] = frozenset()
    ) -> contextlib.AbstractContextManager[list[ParamShard]]:
        return self.wrapped.checkpoint_shards(loading, wanted)


def _copy_key(shard: ParamShard, copies: frozenset[str]) -> Optional[torch.Tensor]:
    """The tensor the optimizer steps for ``shard`` if it is a tied copy (a frozen parameter's kept
    piece, another kind of slot, has no gradient)."""
    slot = shard.state
    return slot.key if shard.name in copies and isinstance(slot, OptimizerSlot) else None
