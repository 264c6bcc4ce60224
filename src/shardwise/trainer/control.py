"""The callbacks as the loop sees them, and decisions every rank takes together (small all-reduces through the
engine's ``Comm``): a stop or save asked on one rank alone would leave the others waiting forever in the next
collective, so any rank asking is every rank doing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["HOOKS", "Agreement", "CallbackList", "Decision", "Requests"]

#: the hooks a callback may have (:mod:`.callbacks`); the loop calls each by name
HOOKS = ("on_train_start", "on_step_end", "on_log", "on_eval_end", "on_save", "on_train_end")


class Agreement:
    """Reductions of a few numbers over the data-parallel ranks (no-ops on one rank)."""

    def __init__(self, comm: Any, device: torch.device) -> None:
        self.comm, self.device = comm, device

    def _reduce(self, values: Sequence[float], op: Any) -> list[float]:
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        self.comm.all_reduce(tensor, op=op)
        return [float(v) for v in tensor.tolist()]

    def sum(self, values: Sequence[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.SUM)

    def max(self, values: Sequence[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.MAX)

    def min(self, values: Sequence[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.MIN)

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (small Python objects), in rank order."""
        return list(self.comm.all_gather_object(value))


@dataclass
class Decision:
    """What the ranks agreed on after a step: stop (and which rank asked first), save."""

    stop: bool = False
    save: bool = False
    asked_by: Optional[int] = None
    reason: Optional[str] = None


@dataclass
class Requests:
    """This rank's pending requests (from callbacks), cleared once decided."""

    stop_reason: Optional[str] = None
    save: bool = False

    def decide(self, agreement: Agreement, rank: int) -> Decision:
        """The agreed decision; collective (every rank calls it once per step)."""
        # rank + 1 marks a stop request: the max names one rank that asked (0: nobody did)
        stop_by, save = agreement.max([rank + 1 if self.stop_reason is not None else 0, float(self.save)])
        self.save = False
        if not stop_by:
            return Decision(save=save > 0)
        asked_by = int(stop_by) - 1
        # Every rank reports the same reason: the asking rank's.
        self.stop_reason = agreement.comm.broadcast_object(self.stop_reason, src=asked_by)
        return Decision(stop=True, save=save > 0, asked_by=asked_by, reason=self.stop_reason)


class CallbackList:
    """Calls a hook on every callback that has it, in order."""

    def __init__(self, callbacks: Iterable[Any]) -> None:
        self.callbacks = list(callbacks)
        for callback in self.callbacks:
            if not any(callable(getattr(callback, hook, None)) for hook in HOOKS):
                raise TypeError(
                    f"callback {callback!r} of type `{type(callback).__name__}` has none of the hooks {list(HOOKS)}; "
                    "define at least one (or subclass `shardwise.trainer.Callback`)")

    def call(self, hook: str, trainer: object, *args: Any) -> None:
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if callable(method):
                method(trainer, *args)
