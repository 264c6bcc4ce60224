"""The interface of every arrangement of the flat stages' fp32 master weights (see :mod:`.masters`).

Kept apart from the arrangements so that one in a module of its own (:mod:`.offloaded`) and
:func:`~.masters.choose_masters`, which picks among all of them, both import it without a cycle.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Mapping, MutableMapping

import torch

from ..distributed import Comm
from ..param_state import OptimizerSlot, StateSlot
from .grads import ReducedGrads
from .layout import FlatLayout
from .store.carry import export_state, import_state
from .store.frozen import Kept

__all__ = ["Gather", "Masters"]

Gather = Callable[[torch.Tensor], torch.Tensor]


class Masters(ABC):
    """This rank's fp32 master weights for a :class:`FlatLayout`."""

    #: whether kept copies of the masters own their memory (False: they are views of the model)
    owns_copies = True

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device) -> None:
        self.layout = layout
        self.dtype = dtype
        self.device = device
        #: the model's flat parameter buffer (empty when the parameters are not flattened)
        self.param_flat = torch.empty(0)
        #: per bucket, this rank's fp32 master slice
        self.slices: list[torch.Tensor] = []
        #: per bucket, this rank's slice of ``param_flat`` (where :meth:`publish` writes the masters)
        self.owned: list[torch.Tensor] = []

    @abstractmethod
    def build(self, initial: Mapping[int, torch.Tensor]) -> None:
        """Lay the trainable parameters out and fill the masters (``initial``: exact fp32 values by id)."""

    def _flatten(self, dtype: torch.dtype) -> None:
        """Move every trainable parameter into one flat buffer of ``dtype`` (they become views of it)."""
        layout = self.layout
        self.param_flat = torch.zeros(layout.padded_numel, dtype=dtype, device=self.device)
        for index, param in enumerate(layout.params):
            view = layout.param_slice(self.param_flat, index)
            view.copy_(param.detach().reshape(-1))
            param.data = view.view_as(param)
        self.owned = [layout.owned_slice(self.param_flat, b) for b in layout.buckets]

    def steps(self, grads: ReducedGrads) -> dict[int, torch.Tensor]:
        """Per parameter id, the fp32 tensor the inner optimizer steps, its ``.grad`` wired to ``grads``."""
        layout = self.layout
        views: dict[int, torch.Tensor] = {}
        for piece in layout.pieces:
            bucket, _ = layout.bucket_of[piece.param]
            at = piece.shard_offset - bucket.shard_offset
            view = self.slices[bucket.index].narrow(0, at, piece.numel)
            view.grad = grads.slices[bucket.index].narrow(0, at, piece.numel)
            views.setdefault(id(layout.params[piece.param]), view)
        return views

    def gather_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per bucket: (the model's region of it, this rank's slice inside that region), fixed views.

        After :meth:`publish` this rank's slice holds its updated values, so an all-gather of each pair,
        in place, re-assembles the updated parameters.
        """
        layout = self.layout
        return [(layout.bucket_slice(self.param_flat, b), owned) for b, owned in zip(layout.buckets, self.owned)]

    def publish(self) -> None:
        """Write the masters into this rank's slice of the model's parameters (cast to the compute dtype);
        nothing where they are that slice already (or where the parameters are the masters)."""
        for owned, master in zip(self.owned, self.slices):
            if owned.data_ptr() != master.data_ptr():
                owned.copy_(master)

    @abstractmethod
    def shard(self) -> torch.Tensor:
        """This rank's masters as one contiguous tensor (a copy where they are not contiguous)."""

    def full(self, gather: Gather) -> dict[int, torch.Tensor]:
        """Full fp32 value of every trainable parameter by id (collective through ``gather``)."""
        layout = self.layout
        flat = gather(self.shard())
        return {id(p): layout.param_slice(flat, i).view_as(p).clone() for i, p in enumerate(layout.params)}

    def step(self, inner: Any) -> None:
        """Step the inner optimizer over the masters and :meth:`publish` them (an offloaded arrangement steps
        them a part at a time)."""
        inner.step()
        self.publish()

    def piece(self, index: int, key: torch.Tensor, state: MutableMapping[Any, Any]) -> tuple[torch.Tensor, StateSlot]:
        """Piece ``index``'s writable fp32 master and where its optimizer state lives, for a checkpoint
        (``key``: the tensor the inner optimizer steps for it)."""
        return key.detach().view(-1), OptimizerSlot(state, key)

    def nbytes(self) -> int:
        """Bytes of master weights held apart from the model's parameters."""
        return 0

    def state_nbytes(self) -> int:
        """Bytes of optimizer state held outside the inner optimizer's ``state`` (a partial offload's resident part)."""
        return 0

    def export(self, state: MutableMapping[Any, Any], steps: dict[int, torch.Tensor], comm: Comm,
               gather: Gather) -> dict[int, Kept]:
        """Every parameter's full master and optimizer state, taken out of ``state`` (collective)."""
        carried = export_state(self.layout, self.shard(), steps, state, comm, gather)
        state.clear()
        return carried

    def adopt(self, carried: Mapping[int, Kept], state: MutableMapping[Any, Any], steps: dict[int, torch.Tensor]) -> None:
        """Fill this rank's new masters and optimizer state from ``carried`` (after a rebuild)."""
        import_state(self.layout, steps, state, carried)

    def release(self) -> None:
        """Give every parameter its own storage again (before the layout is rebuilt)."""
        for param in self.layout.params:
            param.data = param.data.clone()

    def close(self) -> None:
        """Let go of what the arrangement holds outside memory (files of an offloaded one)."""
