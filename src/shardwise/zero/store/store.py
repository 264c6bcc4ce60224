"""One master store for every ZeRO stage: this rank's fp32 master weights and optimizer state.

A :class:`MasterStore` holds this rank's pieces (:class:`~.home.Piece`): the flat stages' slices of their
layout and stage 3's parts of its units alike.  Where their masters and state live is its home, chosen
once (:func:`choose_home`): :class:`Resident` here, :class:`~.nvme.Nvme` in files.  What the store does
once, for every stage and home:

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

from ...optim.param_state import KeptSlot, OptimizerSlot, ParamShard, StateSlot
from ..base import tensor_bytes
from .frozen import FrozenStore, Kept
from .home import Home, ModelSide, Piece, Run
from .nvme import Nvme
from .plan import OffloadSpec

__all__ = ["MasterStore", "NormShare", "Resident", "choose_home"]


class NormShare(NamedTuple):
    """This rank's sum of squared gradients ``sq``, taken as the reduction finished; it holds while every
    ``(key, grad, version)`` in ``seen`` still has ``key.grad is grad`` at that ``grad._version`` (a script
    scaling or replacing the gradients between backward and step makes it stale)."""

    sq: torch.Tensor
    seen: tuple[tuple[torch.Tensor, torch.Tensor, int], ...]


def choose_home(side: ModelSide, offload: Optional[OffloadSpec], fp32_in_memory: bool, device: torch.device) -> Home:
    """Where the state lives, once, for a model on ``device``: in files where ``offload`` asks for NVMe; else in
    memory, the masters the model's own storage where it holds fp32 values in memory."""
    if offload is not None:
        return Nvme(side, offload, pin=offload.pin_memory and device.type == "cuda")
    return Resident(side, fp32_in_memory)


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
        self.side.write([(p, 0, p.key) for p in self.pieces if p.key is not None], last=True)

    def nbytes(self) -> int:
        if self.in_model:
            return 0
        return sum(p.key.numel() * p.key.element_size() for p in self.pieces if p.key is not None)


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
        """The keys' gradients (what the optimizer reads)."""
        return [p.key.grad for p in self.pieces if p.key is not None and p.key.grad is not None]

    def grad_sq(self) -> torch.Tensor:
        """This rank's sum of squared gradients, computed now."""
        return _sum_sq(self.grads())

    def add_reduced(self, reduced: Sequence[tuple[Sequence[Piece], torch.Tensor]], scale: float, last: bool) -> None:
        """Stage 3: for each ``(pieces, slice)`` (a unit's pieces and this rank's slice of its reduced gradients, a
        piece at its ``offset``), add ``scale`` times each piece's part to its gradient (fp32, allocated by the
        first add after :meth:`drop_grads`); ``last``: the reduction finished, and the norm's share is taken once
        over the sums (:class:`NormShare`: the step reads it while it holds)."""
        self.share = None
        for pieces, values in reduced:
            for piece in pieces:
                key = piece.key
                if key is None:
                    continue
                part = values.narrow(0, piece.offset, piece.numel)
                if piece.grad is None:
                    piece.grad = part.float().mul(scale)
                else:
                    piece.grad.add_(part, alpha=scale)
                key.grad = piece.grad
        if last:
            seen = tuple((p.key, p.key.grad, p.key.grad._version) for p in self.pieces
                         if p.key is not None and p.key.grad is not None)
            self.share = NormShare(_sum_sq([grad for _, grad, _ in seen]), seen)

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
        grads = self.grads() if factor != 1.0 else []
        if grads:
            torch._foreach_mul_(grads, factor)
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


def _sum_sq(grads: list[torch.Tensor]) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    return torch.stack(torch._foreach_norm(grads)).square().sum()

