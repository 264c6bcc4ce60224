"""One master store for every ZeRO stage: this rank's fp32 master weights and optimizer state, and what frozen
parameters keep until they train again.

A :class:`MasterStore` holds this rank's pieces (:class:`Piece`: elements ``[start, end)`` of one flattened parameter,
at ``at`` in this rank's *shard*), the flat stages' slices and stage 3's parts of units alike. Where their masters and
state live is its :class:`Home`, chosen once at initialize (:func:`~shardwise.zero.store.choose_home`):

* :class:`Resident`: in memory; the master is the model's own storage where it holds fp32 values (stage 0's parameters,
  the flat stages' buffer slices, stage 3's shards), else a separate fp32 copy;
* :class:`~.nvme.Nvme`: in files, stepped sub-group by sub-group;
* :class:`~.host.Host`: in host memory for a model on an accelerator (ZeRO-Offload).

What the store does once for every stage and home: the optimizer's param groups hold the pieces' keys
(:meth:`MasterStore.keys_for`); the step (scale, leave alone pieces no rank had a gradient for, step, publish); freezing
(:class:`FrozenStore`, :meth:`MasterStore.refresh`; the flat stages rebuild their layout and :meth:`MasterStore.adopt`
takes back what :func:`..flat.strategy.export_state` kept); checkpoint shards (:meth:`MasterStore.shards`); byte
accounting; and masters following values written into the model (:meth:`MasterStore.take`).  Where the state is in host
memory and the model on an accelerator, :attr:`Home.copies` moves gradients down and values up; :meth:`Home.grad_for`,
:meth:`Home.arrived` and :meth:`Home.add_grads` are where stages hand gradients over.

The stages differ in their :class:`ModelSide` (where a piece's values are in the model and how updated masters get
there: ``FlatSide`` in :mod:`..flat.strategy`, ``UnitSide`` in :mod:`..stage3.strategy`) and in how gradients arrive
(the flat stages point each key's ``.grad`` at a fixed view of the reduced buffer; stage 3 adds each unit's reduction,
:meth:`MasterStore.add_reduced`).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Iterator, MutableMapping, NamedTuple, Optional, Protocol, Sequence

import torch

from ...optim.param_state import KeptSlot, OptimizerSlot, ParamShard, StateSlot, copy_value, is_per_element
from ..base import tensor_bytes
from ..flat.layout import Piece as Run
from .copies import DeviceCopies

__all__ = [
    "FrozenStore", "Home", "Kept", "MasterStore", "ModelSide", "NormShare", "Piece", "Resident", "Run", "Runs",
    "planned_index", "sum_sq",
]


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
    """What frozen parameters keep until they train again, by parameter: a parameter that stops training leaves
    the optimizer (as ``torch.optim`` treats one whose ``.grad`` is None), but its fp32 master and state (Adam's
    moments and ``step``) stay here, so unfreezing resumes exactly where it stopped.  The flat stages keep each
    entry whole, replicated (their layout is rebuilt: a rank cannot know which piece it will own next); stage 3
    keeps this rank's piece.  Checkpoints carry the kept state like a trainable one's (:meth:`MasterStore.shards`)."""

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

    The store calls :meth:`plan` once, then :meth:`add` for each piece (in shard order); :meth:`freeze` and :meth:`thaw`
    when a piece stops or starts training (stage 3), :meth:`step` for each optimizer step."""

    #: whether the masters are the model's own storage (nothing to publish, no copy held apart)
    in_model = False

    def __init__(self, side: ModelSide, copies: Optional[DeviceCopies] = None) -> None:
        self.side = side
        #: every piece added, in shard order
        self.pieces: list[Piece] = []
        #: the copies between the model's device and host memory, where the state is on the host and the model
        #: is not (None: the optimizer reads the stage's own gradients)
        self.copies = copies
        #: whether the optimizer reads gradients this home holds apart from the stage's (host copies): the
        #: store's step scales those (:meth:`scale`), not the stage's (an attribute: read on every step)
        self.grads_apart = copies is not None

    def apart(self, piece: Piece) -> bool:
        """Whether ``piece``'s gradient is copied to host memory for its step."""
        return self.copies is not None

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

    def grad_for(self, piece: Piece, grad: torch.Tensor) -> torch.Tensor:
        """What a trainable piece's key holds as ``.grad`` for the stage's reduced gradient ``grad`` (a fixed view,
        the flat stages'): ``grad``, or where the piece's state is in host memory its view of the host gradient
        buffer, which :meth:`arrived` fills."""
        if self.copies is None or not self.apart(piece):
            return grad
        view = self.copies.view(piece.at, piece.numel)
        self.copies.register(piece, view, grad)
        return view

    def arrived(self, pieces: Sequence[Piece]) -> None:
        """The reduced gradients of ``pieces`` (given by :meth:`grad_for`) landed: start copying them to host
        memory, overlapped with the rest of backward."""
        if self.copies is not None:
            self.copies.down(pieces)

    def add_grads(self, parts: Sequence[tuple[Piece, torch.Tensor]], scale: float) -> None:
        """Stage 3: add ``scale`` times each ``part`` (a trainable piece's elements of one reduction, on the
        device) to the piece's fp32 gradient, and point its key's ``.grad`` at it.  The first reduction after
        the gradients were dropped makes the gradient; where it goes to host memory it is scaled on the device,
        its norm taken there, and copied down without waiting."""
        fresh: list[tuple[Piece, torch.Tensor]] = []
        for piece, part in parts:
            if piece.grad is None:
                fresh.append((piece, part.float().mul(scale)))
                continue
            if self.copies is not None and self.apart(piece):
                self.copies.wait()  # a second reduction before the step (rare): added on the host
                self.copies.norms.pop(piece, None)
                piece.grad.add_(part.to(piece.grad.device), alpha=scale)
            else:
                piece.grad.add_(part, alpha=scale)
            assert piece.key is not None
            piece.key.grad = piece.grad
        down = [(piece, grad) for piece, grad in fresh if self.copies is not None and self.apart(piece)]
        if down:
            assert self.copies is not None
            norms = torch._foreach_norm([grad for _, grad in down])
            views = [self.copies.view(piece.at, piece.numel) for piece, _ in down]
            for (piece, _), norm in zip(down, norms):
                self.copies.norms[piece] = norm
            self.copies.down_fresh(list(zip(views, [grad for _, grad in down])))
            for (piece, _), view in zip(down, views):
                piece.grad = view
        for piece, grad in fresh:
            if piece.grad is None:
                piece.grad = grad
            assert piece.key is not None
            piece.key.grad = piece.grad

    def norm_sq(self, grads: Sequence[tuple[Piece, torch.Tensor]]) -> torch.Tensor:
        """The sum of squares of the gradients ``(piece, its key's .grad)``, in order: those copied to host memory
        by their norms taken on the device as they arrived."""
        if self.copies is None:
            return sum_sq([grad for _, grad in grads])
        norms = self.copies.norms
        missing = [(p, grad) for p, grad in grads if p not in norms]
        if any(self.apart(p) for p, _ in missing):
            self.copies.wait()
        taken = dict(zip([p for p, _ in missing], torch._foreach_norm([g for _, g in missing]))) if missing else {}
        if not grads:
            return torch.zeros((), dtype=torch.float32)
        return torch.stack([(norms[p] if p in norms else taken[p]).to(self.copies.device) for p, _ in grads]).square().sum()

    def settle_grads(self) -> None:
        """The gradients the optimizer reads are complete (copies to host memory finished)."""
        if self.copies is not None:
            self.copies.wait()

    def scale(self, factor: float) -> None:
        """Multiply the gradients the optimizer reads by ``factor`` (unscale and clip)."""
        self.settle_grads()
        grads = [p.key.grad for p in self.pieces if p.key is not None and p.key.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)

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


def planned_index(piece: Piece, runs: Sequence[Run], taken: int, rank: int, laid_out: str) -> int:
    """Where ``piece`` (the ``taken``-th added) sits in ``runs``, the plan a home laid its ``laid_out`` buffers out
    for; a piece that does not match is a bug, said so."""
    if taken >= len(runs) or (runs[taken].shard_offset, runs[taken].numel) != (piece.at, piece.numel):
        raise RuntimeError(f"rank {rank}: the pieces do not match the plan their {laid_out} were laid out for (a bug "
                           "in shardwise); please report it")
    return taken


def sum_sq(grads: list[torch.Tensor]) -> torch.Tensor:
    """The sum of squares of ``grads``, from their norms (zero for none)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    return torch.stack(torch._foreach_norm(grads)).square().sum()


class NormShare(NamedTuple):
    """This rank's sum of squared gradients ``sq``, taken as the reduction finished; it holds while every
    ``(key, grad, version)`` in ``seen`` still has ``key.grad is grad`` at that ``grad._version`` (a script
    scaling or replacing the gradients between backward and step makes it stale)."""

    sq: torch.Tensor
    seen: tuple[tuple[torch.Tensor, torch.Tensor, int], ...]


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
    """This rank's pieces with their masters and optimizer state, in one :class:`Home` (module docstring)."""

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
            view = self.side.view(piece) if self.home.in_model else None  # from the model's values: a load fills it
            master = view if view is not None else self.side.values(piece)
            self.frozen.keep(piece.param, Kept(piece.start, piece.end, master))
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
