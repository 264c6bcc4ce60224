"""The store's home in memory: the masters are the model's own storage, or fp32 copies beside it; the optimizer
state is in the inner optimizer's ``state``, as without ZeRO."""

from __future__ import annotations

from typing import Any, MutableMapping, Optional

import torch

from ...optim.param_state import KeptSlot, OptimizerSlot, StateSlot
from .frozen import Kept
from .home import Home, ModelSide, Piece

__all__ = ["Resident"]


class Resident(Home):
    """Masters in memory: the model's own storage (``in_model``) or separate fp32 copies; state in the optimizer."""

    def __init__(self, side: ModelSide, in_model: bool) -> None:
        super().__init__(side)
        self.in_model = in_model

    def start(self, piece: Piece, initial: torch.Tensor) -> torch.Tensor:
        if self.in_model:
            view = self.side.view(piece)
            if view is None:
                raise RuntimeError(f"`{piece.name}` has no fp32 values in memory to step in place (a bug in "
                                   "shardwise); please report it")
            return view
        return initial.to(torch.float32, copy=True)

    def master(self, piece: Piece) -> torch.Tensor:
        assert piece.key is not None
        return piece.key.detach().view(-1)

    def slot(self, piece: Piece, state: MutableMapping[Any, Any]) -> StateSlot:
        assert piece.key is not None
        return OptimizerSlot(state, piece.key)

    def freeze(self, piece: Piece, state: MutableMapping[Any, Any]) -> Kept:
        key = piece.key  # (1-D: stage 3's; kept itself, so a view of the model stays one)
        assert key is not None
        kept = Kept(piece.start, piece.end, key, KeptSlot(OptimizerSlot(state, key).get()))
        state.pop(key, None)
        return kept

    def thaw(self, piece: Piece, kept: Optional[Kept], state: MutableMapping[Any, Any]) -> None:
        if kept is None:  # frozen since initialize: the model's values are the best there are
            piece.key = self.side.view(piece) if self.in_model else self.side.values(piece)
            return
        piece.key = kept.master
        if kept.state:
            OptimizerSlot(state, kept.master).set(kept.state)

    def step(self, inner: Any) -> None:
        inner.step()
        self.publish()

    def publish(self) -> None:
        if self.in_model:
            return  # the optimizer stepped the model's own values
        self.side.write([(p, 0, p.key) for p in self.pieces if p.key is not None])
        self.side.settle()

    def nbytes(self) -> int:
        if self.in_model:
            return 0
        return sum(p.key.numel() * p.key.element_size() for p in self.pieces if p.key is not None)
