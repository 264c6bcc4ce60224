"""What the master store (:mod:`.store`) is made of: pieces, the model's side of them, and a home for their state.

A :class:`Piece` is the part of one parameter this rank owns: elements ``[start, end)`` of it, flattened, at
``at`` in this rank's *shard* (its pieces one after the other, as the flat layout or stage 3's units cut
them).  The store keeps each piece's fp32 master and optimizer state; *where* they live is its :class:`Home`,
chosen once at initialize (:func:`~.store.choose_home`):

* :class:`~.store.Resident`: in memory.  The master is the model's own storage where the model holds fp32
  values in memory (stage 0's parameters, the flat stages' slices of their parameter buffer, stage 3's
  shards), else a separate fp32 copy; the inner optimizer's ``state`` holds the state.
* :class:`~.nvme.Nvme`: in files, stepped sub-group by sub-group (``offload_optimizer: {device: nvme}``,
  ``ratio`` keeping the first sub-groups in memory).

A home in host memory for a job on a GPU is one more subclass of :class:`Home`, written once for every stage.

What differs between the stages is the :class:`ModelSide`: where a piece's values are in the model and how
updated masters get there (:mod:`..flat_side`: this rank's slice of the flat parameter buffer, all-gathered
after the step; :mod:`..unit_side`: the units' shards).  How gradients arrive is the stages' own: the flat
stages point each key's ``.grad`` at a fixed view of the reduced gradient buffer, stage 3 adds each unit's
reduction as it finishes (:meth:`~.store.MasterStore.add_reduced`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, MutableMapping, Optional, Protocol, Sequence

import torch

from ...optim.param_state import StateSlot
from ..flat.layout import Piece as Run
from .frozen import Kept

__all__ = ["Home", "ModelSide", "Piece", "Run", "Runs"]


@dataclass(eq=False)
class Piece:
    """Elements ``[start, end)`` of ``param`` (flattened, of shape ``shape``) that this rank owns, at ``at`` in its
    shard (-1: a frozen parameter of the flat stages, kept whole outside it), in param group ``group``.

    ``key`` is the tensor the inner optimizer steps for it (None while frozen); ``grad`` its reduced fp32
    gradient where one accumulates (stage 3).  ``index`` and ``offset`` say where it is in the model: the
    parameter's index in the flat layout, or in ``unit`` and the piece's place in that unit's shard."""

    param: torch.Tensor
    name: str
    shape: torch.Size
    start: int
    end: int
    at: int
    group: int
    index: int
    offset: int = 0
    unit: Any = None
    key: Optional[torch.Tensor] = None
    grad: Optional[torch.Tensor] = None
    #: ``end - start`` (a field, not a property: read on the gradient's path)
    numel: int = field(init=False)

    def __post_init__(self) -> None:
        self.numel = self.end - self.start


#: updated values for the model: ``values`` into elements ``[at, at + len(values))`` of the piece
Runs = Sequence[tuple[Piece, int, torch.Tensor]]


class ModelSide(Protocol):
    """Where a piece's values are in the model, and how updated masters get there (a stage's side of the store)."""

    def view(self, piece: Piece) -> Optional[torch.Tensor]:
        """The piece's values in the model as a tensor the optimizer may step in place (fp32, in memory), else None."""
        ...

    def values(self, piece: Piece) -> torch.Tensor:
        """A new fp32 copy of the piece's values in the model."""
        ...

    def write(self, runs: Runs, last: bool = False) -> None:
        """Updated masters into the model (cast to its dtype); ``last``: no write of this publication follows (as
        :meth:`settle` after it, in the same call: a publication in one write asks once)."""
        ...

    def settle(self) -> None:
        """After the last :meth:`write` of a publication (stage 3 lets the last shard it wrote leave memory)."""
        ...


class Home(ABC):
    """Where the masters and optimizer state of a store's pieces live (see the module docstring).

    The store calls :meth:`plan` once, then :meth:`add` for each piece (in shard order);
    :meth:`freeze` and :meth:`thaw` when a piece stops or starts training (stage 3), :meth:`step` for each
    optimizer step."""

    #: whether the masters are the model's own storage (nothing to publish, no copy held apart)
    in_model = False

    def __init__(self, side: ModelSide) -> None:
        self.side = side
        #: every piece added, in shard order
        self.pieces: list[Piece] = []

    def plan(self, runs: Sequence[Run], numel: int, inner: Any) -> None:
        """Before the first :meth:`add`: the runs of the shard the pieces will fill, in order, within its
        ``numel`` elements (a home keeping them outside memory lays out its files), for ``inner``."""

    def add(self, piece: Piece, initial: Optional[torch.Tensor]) -> None:
        """Take the next piece of the shard; one trainable now (``initial``: its exact values, any dtype; None:
        frozen) gets its key."""
        self.pieces.append(piece)
        if initial is not None:
            piece.key = self.start(piece, initial)

    @abstractmethod
    def start(self, piece: Piece, initial: torch.Tensor) -> torch.Tensor:
        """The key of a piece trainable when added, its master starting at ``initial``."""

    @abstractmethod
    def master(self, piece: Piece) -> torch.Tensor:
        """A trainable piece's fp32 master, 1-D and writable (a checkpoint load writes through it)."""

    @abstractmethod
    def slot(self, piece: Piece, state: MutableMapping[Any, Any]) -> StateSlot:
        """Where a trainable piece's optimizer state lives (``state``: the inner optimizer's)."""

    @abstractmethod
    def freeze(self, piece: Piece, state: MutableMapping[Any, Any]) -> Kept:
        """A piece stops training: its master and optimizer state, taken out to keep."""

    @abstractmethod
    def thaw(self, piece: Piece, kept: Optional[Kept], state: MutableMapping[Any, Any]) -> None:
        """A piece trains again: its key, master and state from ``kept`` (None: from the model's values)."""

    @abstractmethod
    def step(self, inner: Any) -> None:
        """Step the inner optimizer over the trainable keys and publish the updated masters into the model."""

    @abstractmethod
    def publish(self) -> None:
        """Every trainable master into the model, where they are not the model's storage already."""

    def loading(self) -> None:
        """A checkpoint load may write the masters (:meth:`publish` then takes them to the model)."""

    def check_whole(self, doing: str) -> None:
        """Raise where the state cannot be ``doing`` (a step of an offloaded state failed part-way)."""

    def nbytes(self) -> int:
        """Bytes of masters held apart from the model (the kept masters of frozen pieces aside)."""
        return 0

    def state_nbytes(self) -> int:
        """Bytes of optimizer state held outside the inner optimizer's ``state`` (a partial offload's resident part)."""
        return 0

    def close(self) -> None:
        """Let go of what is held outside memory (files)."""
