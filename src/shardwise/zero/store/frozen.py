"""What frozen parameters keep until they train again: fp32 master weights and optimizer state.

A parameter that stops training leaves the optimizer (as ``torch.optim`` treats one whose ``.grad`` is None),
but its fp32 master and state (Adam's moments and ``step``) are kept here, so unfreezing resumes exactly where
it stopped.  The flat stages keep each entry whole, replicated (their layout is rebuilt, so a rank cannot know
which piece it will own next); stage 3 keeps this rank's piece.  Checkpoints carry the kept state like a
trainable parameter's (:meth:`~.store.MasterStore.shards`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ...optim.param_state import KeptSlot, copy_value, is_per_element

__all__ = ["FrozenStore", "Kept"]


@dataclass
class Kept:
    """Elements ``[start, end)`` of one parameter: fp32 master (1-D) and optimizer state."""

    start: int
    end: int
    master: torch.Tensor
    slot: KeptSlot = field(default_factory=lambda: KeptSlot({}))

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def state(self) -> dict[str, Any]:
        return self.slot.state

    def piece(self, start: int, end: int) -> "Kept":
        """A copy of the elements ``[start, end)`` (inside this entry): master and per-element state."""
        lo, count = start - self.start, end - start
        state = {
            k: (v.narrow(0, lo, count).clone() if is_per_element(v, self.numel) else copy_value(v))
            for k, v in self.state.items()
        }
        return Kept(start, end, self.master.narrow(0, lo, count).clone(), KeptSlot(state))


class FrozenStore:
    """Kept state of frozen parameters, by parameter (see the module docstring)."""

    def __init__(self) -> None:
        self._kept: dict[int, Kept] = {}

    def keep(self, param: torch.Tensor, kept: Kept) -> None:
        self._kept[id(param)] = kept

    def get(self, param: torch.Tensor) -> Optional[Kept]:
        return self._kept.get(id(param))

    def take(self, param: torch.Tensor) -> Optional[Kept]:
        """Remove and return ``param``'s entry (it trains again)."""
        return self._kept.pop(id(param), None)

    def master_bytes(self) -> int:
        """Bytes of the kept fp32 masters that hold memory of their own (a view of the model's values holds none)."""
        return sum(kept.master.numel() * kept.master.element_size() for kept in self._kept.values()
                   if not kept.master._is_view())

    def state_bytes(self) -> int:
        """Bytes of the kept optimizer-state tensors."""
        return sum(
            v.numel() * v.element_size()
            for kept in self._kept.values()
            for v in kept.state.values()
            if isinstance(v, torch.Tensor)
        )
