"""One master store for every ZeRO stage: this rank's fp32 master weights and optimizer state.

A :class:`MasterStore` holds this rank's pieces (:class:`~.home.Piece`): the flat stages' slices of their
layout and stage 3's parts of its units alike.  Where their masters and state live is its home, chosen
once (:func:`choose_home`): :class:`~.resident.Resident` in memory, :class:`~.nvme.Nvme` in files,
:class:`~.host.Host` in host memory for a model on an accelerator.  What the store does once, for every stage
and home:

* the inner optimizer's param groups hold the trainable pieces' keys (:meth:`MasterStore.keys_for`);
* the step (:meth:`MasterStore.step`): gradients scaled, pieces no rank had a gradient for left alone as
  torch leaves a parameter whose ``.grad`` is None, the home stepped, updated masters published through the
  stage's :class:`~.home.ModelSide`;
* freezing: a piece that stops training leaves the optimizer, its master and state kept
  (:class:`~.frozen.FrozenStore`) until it trains again (:meth:`MasterStore.refresh`; the flat stages
  rebuild their layout instead, :meth:`MasterStore.adopt` taking back what :mod:`.carry` kept);
* checkpoints: each piece as a :class:`~shardwise.optim.param_state.ParamShard`, frozen ones included
  (:meth:`MasterStore.shards`);
* byte accounting; and values written into the model: the masters follow (:meth:`MasterStore.take`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, MutableMapping, NamedTuple, Optional, Sequence

import torch

from ...optim.param_state import ParamShard
from ..base import tensor_bytes
from .copies import DeviceCopies
from .frozen import FrozenStore, Kept
from .home import Home, ModelSide, Piece, Run, sum_sq
from .host import Host
from .nvme import Nvme
from .plan import OffloadSpec
from .resident import Resident

__all__ = ["MasterStore", "NormShare", "Resident", "choose_home"]


class NormShare(NamedTuple):
    """This rank's sum of squared gradients ``sq``, taken as the reduction finished; it holds while every
    ``(key, grad, version)`` in ``seen`` still has ``key.grad is grad`` at that ``grad._version`` (a script
    scaling or replacing the gradients between backward and step makes it stale)."""

    sq: torch.Tensor
    seen: tuple[tuple[torch.Tensor, torch.Tensor, int], ...]


def choose_home(side: ModelSide, offload: Optional[OffloadSpec], fp32_in_memory: bool, device: torch.device,
                dtype: torch.dtype = torch.float32) -> Home:
    """Where the state lives, once, for a model on ``device`` computing in ``dtype``: in files where ``offload``
    asks for NVMe, in host memory where it asks for ``cpu`` (both with copies to and from the device where the
    model is not in host memory: ``offload.copies``); else in memory, the masters the model's own storage where
    it holds fp32 values in memory."""
    if offload is None:
        return Resident(side, fp32_in_memory)
    copies = DeviceCopies(device, dtype, offload.pin_memory)
    if offload.device == "cpu":  # (asked for only where it moves the state: `offload.copies`)
        return Host(side, offload, copies, fp32_in_memory)
    return Nvme(side, offload, pin=offload.pin_memory and device.type == "cuda", copies=copies if offload.copies else None)


class MasterStore:
    """This rank's pieces with their masters and optimizer state, in one :class:`~.home.Home` (module docstring)."""

    def __init__(self, home: Home, frozen: Optional[FrozenStore] = None) -> None:
        self.home = home
        self.pieces: list[Piece] = []
        self.by_param: dict[int, Piece] = {}
        #: masters and optimizer state of frozen parameters, kept until they train again
        self.frozen = frozen if frozen is not None else FrozenStore()
        #: this rank's sum of squared gradients, taken as the reduction finished (None: cleared since)
        self.share: Optional[NormShare] = None

    @property
    def side(self) -> ModelSide:
        return self.home.side

    # ---------------------------------------------------------------- build
    def plan(self, runs: Sequence[Run], numel: int, inner: Any) -> None:
        """Before the first :meth:`add` (:meth:`.Home.plan`)."""
        self.home.plan(runs, numel, inner)

    def add(self, piece: Piece, initial: Optional[torch.Tensor]) -> None:
        """The next piece, in shard order (frozen flat-stage parameters, kept whole, last); ``initial``: its
        exact values where it trains now, None where it is frozen."""
        self.pieces.append(piece)
        self.by_param[id(piece.param)] = piece
        self.home.add(piece, initial)

    def keys_for(self, originals: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What the inner optimizer steps in place of the param group ``originals``: the trainable keys."""
        return [p.key for param in originals if (p := self.by_param.get(id(param))) is not None and p.key is not None]

    # -------------------------------------------------------- trainability
    def refresh(self, state: MutableMapping[Any, Any]) -> bool:
        """Stage 3: newly trainable pieces get their master (the kept one, or the model's values); newly frozen
        ones leave the optimizer (``state``), their master and state kept.  True if anything moved."""
        moved = False
        for piece in self.pieces:
            if piece.param.requires_grad and piece.key is None:
                self.home.check_whole("change the trainable set")
                self.home.thaw(piece, self.frozen.take(piece.param), state)
                moved = True
            elif not piece.param.requires_grad and piece.key is not None:
                self.home.check_whole("change the trainable set")
                self.frozen.keep(piece.param, self.home.freeze(piece, state))
                piece.key.grad = None
                piece.key, piece.grad = None, None
                moved = True
        if moved:
            self.share = None  # a frozen piece's gradient left the sum
        return moved

    def adopt(self, carried: dict[int, Kept], state: MutableMapping[Any, Any]) -> None:
        """The flat stages after a rebuild: fill the trainable pieces' masters and state from ``carried``."""
        self.home.loading()
        for piece in self.pieces:
            entry = carried.get(id(piece.param))
            if piece.key is None or entry is None:
                continue  # never trained before: the master came from the parameter, the state starts fresh
            mine = entry.piece(piece.start, piece.end)  # (a copy)
            self.home.master(piece).copy_(mine.master)
            if mine.state:
                self.home.slot(piece, state).set(mine.state)

    # ----------------------------------------------------------- masters
    def master_or_kept(self, piece: Piece) -> Optional[torch.Tensor]:
        """The piece's master, or the one kept while it is frozen (None: frozen since initialize)."""
        if piece.key is not None:
            return self.home.master(piece)
        kept = self.frozen.get(piece.param)
        return kept.master if kept is not None else None

    def take(self, piece: Piece, values: torch.Tensor) -> None:
        """New values were written into the model for ``piece``: its master (or kept master) follows."""
        if self.home.in_model:
            return  # every master, kept ones too, is the model's storage that took them
        master = self.master_or_kept(piece)
        if master is not None:
            master.copy_(values)

    def shard(self, numel: int, device: torch.device) -> torch.Tensor:
        """This rank's masters as one fp32 tensor of the shard's ``numel`` elements (zeros between pieces)."""
        shard = torch.zeros(numel, dtype=torch.float32, device=device)
        for piece in self.pieces:
            if piece.key is not None:
                shard.narrow(0, piece.at, piece.numel).copy_(self.home.master(piece))
        return shard

    # ------------------------------------------------------------ gradients
    def grads(self) -> list[torch.Tensor]:
        """The keys' gradients (what the optimizer reads; copies to host memory finished first)."""
        self.home.settle_grads()
        return [p.key.grad for p in self.pieces if p.key is not None and p.key.grad is not None]

    def grad_sq(self) -> torch.Tensor:
        """This rank's sum of squared gradients, computed now."""
        return sum_sq(self.grads())

    def add_reduced(self, reduced: Sequence[tuple[Sequence[Piece], torch.Tensor]], scale: float, last: bool) -> None:
        """Stage 3: for each ``(pieces, slice)`` (a unit's pieces and this rank's slice of its reduced gradients, a
        piece at its ``offset``), add ``scale`` times each piece's part to its gradient (fp32, allocated by the
        first add after :meth:`drop_grads`); ``last``: the reduction finished, and the norm's share is taken once
        over the sums (:class:`NormShare`: the step reads it while it holds)."""
        self.share = None
        for pieces, values in reduced:
            self.home.add_grads([(p, values.narrow(0, p.offset, p.numel)) for p in pieces if p.key is not None], scale)
        if last:
            counted = [(p, key, grad) for p in self.pieces if (key := p.key) is not None and (grad := key.grad) is not None]
            sq = self.home.norm_sq([(p, grad) for p, _, grad in counted])
            self.share = NormShare(sq, tuple((key, grad, grad._version) for _, key, grad in counted))

    def drop_grads(self) -> None:
        """Stage 3: every gradient goes (the next reduction allocates it again)."""
        self.share = None
        for piece in self.pieces:
            piece.grad = None
            if piece.key is not None:
                piece.key.grad = None

    # ------------------------------------------------------------------ step
    def step(self, inner: Any, factor: float = 1.0, unused: Sequence[Piece] = (), release: bool = False) -> None:
        """The optimizer step over the trainable keys: their gradients multiplied by ``factor`` (unscale and
        clip), the pieces ``unused`` (no rank had a gradient for them) left alone, as torch leaves a parameter
        whose ``.grad`` is None (no momentum, no weight decay), and the updated masters published; ``release``:
        the gradients dropped afterwards (:meth:`drop_grads`, stage 3's)."""
        self.share = None
        if factor != 1.0:
            self.home.scale(factor)
        hidden = [(p.key, p.key.grad) for p in unused if p.key is not None and p.key.grad is not None]
        for key, _ in hidden:
            key.grad = None
        try:
            self.home.step(inner)
        finally:
            for key, grad in hidden:
                key.grad = grad
        if release:
            self.drop_grads()

    def publish(self) -> None:
        """Every master into the model (after a load)."""
        self.home.publish()

    # ------------------------------------------------------------ checkpoint
    @contextlib.contextmanager
    def shards(self, state: MutableMapping[Any, Any], loading: bool,
               wanted: frozenset[str] = frozenset()) -> Iterator[list[ParamShard]]:
        """One :class:`ParamShard` per trainable piece and per frozen one with a kept master (``state``: the inner
        optimizer's).  Loading: frozen pieces named in ``wanted`` (the checkpoint has optimizer state for them)
        get a kept entry too, to receive it; on a clean exit every kept master is written into the model."""
        self.home.check_whole("save or load a checkpoint")
        frozen = [p for p in self.pieces if p.key is None]
        if not loading:
            yield self._shards(state, frozen)
            return
        self.home.loading()
        temporary = [p for p in frozen if p.name in wanted and self.frozen.get(p.param) is None]
        for piece in temporary:
            self.frozen.keep(piece.param, self._fresh_kept(piece))
        try:
            yield self._shards(state, frozen)
        except BaseException:
            for piece in temporary:
                self.frozen.take(piece.param)
            raise
        self.side.write([(p, 0, kept.master) for p in frozen if (kept := self.frozen.get(p.param)) is not None])
        self.side.settle()
        for piece in temporary:
            kept = self.frozen.get(piece.param)
            if kept is not None and not kept.state:  # one that received no state needs none
                self.frozen.take(piece.param)

    def _shards(self, state: MutableMapping[Any, Any], frozen: list[Piece]) -> list[ParamShard]:
        shards = [ParamShard(p.name, p.shape, p.start, p.end, self.home.master(p), p.group, self.home.slot(p, state))
                  for p in self.pieces if p.key is not None]
        for piece in frozen:
            kept = self.frozen.get(piece.param)
            if kept is not None:
                shards.append(ParamShard(piece.name, piece.shape, kept.start, kept.end, kept.master, piece.group,
                                         kept.slot))
        return shards

    def _fresh_kept(self, piece: Piece) -> Kept:
        """A kept entry for a piece frozen with no master kept, from the model's values, so a load can fill it."""
        view = self.side.view(piece) if self.home.in_model else None
        return Kept(piece.start, piece.end, view if view is not None else self.side.values(piece))

    # ------------------------------------------------------------ accounting
    def master_bytes(self) -> int:
        """Bytes of masters held apart from the model's parameters, kept ones included (a kept master that is a
        view of the model holds none)."""
        return self.home.nbytes() + self.frozen.master_bytes()

    def state_bytes(self, state: MutableMapping[Any, Any]) -> int:
        """Bytes of optimizer state: the inner optimizer's ``state``, kept and held elsewhere by the home."""
        return tensor_bytes(list(state.values())) + self.frozen.state_bytes() + self.home.state_nbytes()

    def close(self) -> None:
        """Let go of what the home holds outside memory (files; ``engine.destroy()``)."""
        self.home.close()
