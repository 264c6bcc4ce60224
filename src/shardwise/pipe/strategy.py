"""A stage's ZeRO strategy as the optimizer and the checkpoint layer must see it in a pipeline.

The stage's own strategy (stage 0 or 1 over the data-parallel group) does the
work; this wrapper changes two things that only a pipeline knows about:

* the gradient norm: a tied weight has a copy on several stages, each with
  the same (summed) gradient; it must count once in the global norm, so the
  copies whose first holder is another stage are left out of ``grad_sq``;
* checkpoints: those copies are written once (by the first holder; their
  pieces on other stages are cut differently by ZeRO-1, and overlapping
  pieces of one tensor are not a valid checkpoint), but loaded everywhere;
  and before a save or load the engine gets a collective moment, after every
  rank has joined the call, to prepare the whole model's names
  (``prepare_checkpoint``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch

from ..zero.base import ParamShard, Strategy

__all__ = ["PipelineStrategy"]


class PipelineStrategy(Strategy):
    """Delegates to ``inner``; see the module docstring for what differs."""

    def __init__(self, inner: Strategy, copies: frozenset[str]) -> None:
        # Strategy.__init__ is not called: every attribute resolves on `inner` (see __getattr__).
        self.wrapped = inner
        # fixed for the life of a strategy; the class attributes of Strategy would shadow __getattr__
        self.stage = inner.stage
        self.shards_grads = inner.shards_grads
        self.loss_divisor = inner.loss_divisor
        self.copies = copies
        self._saving = False
        #: called with ``loading`` once every rank is inside a save/load, before it reads names
        self.prepare_checkpoint: Optional[Callable[[bool], None]] = None

    def __getattr__(self, name: str) -> Any:
        if name == "wrapped":
            raise AttributeError(name)
        return getattr(self.wrapped, name)

    # ------------------------------------------------------------ changed
    def grad_sq(self) -> torch.Tensor:
        total = self.wrapped.grad_sq()
        counted: set[int] = set()
        for shard in self.wrapped.param_shards():
            grad = shard.key.grad  # what the optimizer steps `key` with: this rank's reduced piece
            if shard.name in self.copies and grad is not None and id(shard.key) not in counted:
                counted.add(id(shard.key))
                flat = grad.reshape(-1).float()
                total = total - torch.dot(flat, flat)
        return total

    def param_shards(self) -> list[ParamShard]:
        shards = self.wrapped.param_shards()
        if self._saving:
            return [s for s in shards if s.name not in self.copies]
        return shards

    @contextlib.contextmanager
    def checkpoint_view(self, loading: bool, wanted: frozenset[str] = frozenset()) -> Iterator[None]:
        if self.prepare_checkpoint is not None:
            self.prepare_checkpoint(loading)
        with self.wrapped.checkpoint_view(loading, wanted):
            self._saving = not loading
            try:
                yield
            finally:
                self._saving = False

    # ------------------------------------------------------------ delegated
    def attach(self, inner: Optional[Any], initial: Optional[dict[int, torch.Tensor]] = None) -> None:
        self.wrapped.attach(inner, initial)

    def start_backward(self, sync: bool) -> None:
        self.wrapped.start_backward(sync)

    def finish_backward(self) -> None:
        self.wrapped.finish_backward()

    def scale_grads(self, factor: float) -> None:
        self.wrapped.scale_grads(factor)

    def after_step(self) -> None:
        self.wrapped.after_step()

    def zero_grad(self) -> None:
        self.wrapped.zero_grad()

    def memory_breakdown(self) -> dict[str, int]:
        return self.wrapped.memory_breakdown()

    def full_master_weights(self) -> dict[int, torch.Tensor]:
        return self.wrapped.full_master_weights()

    def sync_params_from_master(self) -> None:
        self.wrapped.sync_params_from_master()

    def refresh_trainable(self) -> None:
        self.wrapped.refresh_trainable()

    def trainable_changed(self) -> bool:
        return self.wrapped.trainable_changed()

    def has_pending_grads(self) -> bool:
        return self.wrapped.has_pending_grads()

    def close(self) -> None:
        self.wrapped.close()
