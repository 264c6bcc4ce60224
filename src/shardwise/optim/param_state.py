"""One parameter's piece on this rank and its optimizer state.

The vocabulary the ZeRO stages and the checkpoint layer share.  A stage keeps, for every parameter it trains (and
every frozen one that keeps state to resume later), the fp32 master of the elements ``[start, end)`` of the
flattened parameter that this rank owns, and the optimizer state of those elements.  A :class:`ParamShard` describes
one such piece; its :class:`StateSlot` says where that piece's optimizer state lives (inside the inner optimizer, or
in the store of a frozen parameter), so nobody outside the stage needs to know.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, MutableMapping, Protocol

import torch

__all__ = ["KeptSlot", "OptimizerSlot", "ParamShard", "StateSlot", "copy_value", "is_per_element"]


def copy_value(value: Any) -> Any:
    """A copy of an optimizer state value: tensors cloned, the rest (a step count as a number) as it is."""
    return value.clone() if isinstance(value, torch.Tensor) else value


def is_per_element(value: Any, numel: int) -> bool:
    """Whether optimizer state ``value`` has one entry per parameter element (Adam's moments).

    Anything else (Adam's ``step``, a scalar, a plain number) is kept whole.
    """
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel


class StateSlot(Protocol):
    """Where one piece's optimizer state lives; per-element tensors are 1-D through this interface."""

    def get(self) -> dict[str, Any]:
        """The state (empty if the optimizer has not stepped this piece)."""

    def set(self, state: dict[str, Any]) -> None:
        """Replace the state (per-element tensors given 1-D, ``numel`` elements)."""


class OptimizerSlot:
    """The inner optimizer's ``state[key]``, where ``key`` is the tensor its param group holds."""

    def __init__(self, state: MutableMapping[Any, Any], key: torch.Tensor) -> None:
        self.state = state
        self.key = key

    def get(self) -> dict[str, Any]:
        numel = self.key.numel()
        entries = self.state.get(self.key) or {}
        return {k: (v.reshape(-1) if is_per_element(v, numel) else v) for k, v in entries.items()}

    def set(self, state: dict[str, Any]) -> None:
        numel, shape = self.key.numel(), self.key.shape
        # the optimizer sees state shaped like the tensor it steps (a whole parameter at stage 0)
        self.state[self.key] = {k: (v.view(shape) if is_per_element(v, numel) else v) for k, v in state.items()}


@dataclass
class KeptSlot:
    """State kept outside the optimizer (a frozen parameter's), as a plain dict."""

    state: dict[str, Any]

    def get(self) -> dict[str, Any]:
        return self.state

    def set(self, state: dict[str, Any]) -> None:
        self.state = state


@dataclass
class ParamShard:
    """The piece of one parameter this rank holds: elements ``[start, end)`` of it, flattened.

    ``master`` is the writable fp32 1-D tensor of those elements; ``state``
    where their optimizer state lives; ``group`` the param-group index.
    """

    name: str
    shape: torch.Size
    start: int
    end: int
    master: torch.Tensor
    group: int
    state: StateSlot

    @property
    def numel(self) -> int:
        return self.end - self.start
