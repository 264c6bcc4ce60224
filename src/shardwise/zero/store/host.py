"""The store's home in host memory for a model on an accelerator (``offload_optimizer: {device: cpu}``, ZeRO-Offload).

This rank's fp32 masters, gradients and optimizer state live in host memory; the model trains on the device.
Gradients go down as each bucket or unit lands (:class:`~.copies.DeviceCopies`; the norm is taken on the
device).  The step waits for those copies, then steps the inner optimizer sub-group by sub-group (runs of whole
pieces of at most ``sub_group_size`` elements, :func:`~.plan.whole_sub_groups`, as DeepSpeed's), each scaled
just before its step (by the fused kernel itself, as GradScaler's ``grad_scale``); torch's Adam and AdamW use their
fused CPU kernel (:func:`fused_on_host`; 4-8x their for-loop and foreach kernels on this machine's CPU, ``python -m
benchmarks.offload_adam``) unless built asking for another.  Each sub-group's updated masters go up in the compute
dtype while the next one steps.

``offload_optimizer.ratio`` below 1 is DeepSpeed's partial offload: of ``n`` sub-groups the first
``int((1 - ratio) * n)`` stay on the device (a :class:`~.store.Resident` home of their own), stepped there first.
The state of every piece is in the inner optimizer's ``state``, keyed by its master, as in memory.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, MutableMapping, Optional, Sequence

import torch

from ...optim.param_state import OptimizerSlot, StateSlot
from .copies import DeviceCopies
from .plan import OffloadSpec, whole_sub_groups
from .store import Home, Kept, ModelSide, Piece, Run, planned_index
from .subgroups import stepping_only

__all__ = ["Host", "fused_on_host"]

logger = logging.getLogger("shardwise")

_FUSABLE = (torch.optim.Adam, torch.optim.AdamW)


@contextlib.contextmanager
def fused_on_host(inner: Any) -> Iterator[None]:
    """Inside, a torch Adam or AdamW built without a kernel choice (``foreach`` and ``fused`` unset) steps with its
    fused CPU kernel: the same update as its for-loop, within a float rounding, 4-8x faster here."""
    groups = [g for g in getattr(inner, "param_groups", []) if type(inner) in _FUSABLE and g.get("fused") is None
              and g.get("foreach") is None and not g.get("differentiable") and not g.get("capturable")]
    for group in groups:
        group["fused"] = True
    try:
        yield
    finally:
        for group in groups:
            group["fused"] = None


@contextlib.contextmanager
def _scaled_in_step(inner: Any, pieces: Sequence[Piece], factor: float) -> Iterator[None]:
    """The gradients of ``pieces`` multiplied by ``factor`` (unscale and clip) for the step inside: by the fused kernel
    itself where every group runs it (torch's ``grad_scale``, which GradScaler uses: the gradient divided by
    ``1 / factor`` as it is read, within a float rounding of the product), else by a pass of their own first.  The
    fused way spares a pass over the fp32 gradients: the host step 24% faster on 50M elements here (44.0 against
    33.6 ms, median of 7)."""
    if factor == 1.0:
        yield
        return
    takes_scale = type(inner) in _FUSABLE or getattr(inner, "_step_supports_amp_scaling", False)
    fused = takes_scale and all(g.get("fused") for g in inner.param_groups)
    if not fused:
        torch._foreach_mul_([g for p in pieces if p.key is not None and (g := p.key.grad) is not None], factor)
        yield
        return
    inner.grad_scale = torch.tensor(1.0 / factor, dtype=torch.float32)
    try:
        yield
    finally:
        del inner.grad_scale


class _PlacedSlot(OptimizerSlot):
    """A host piece's state: what is set (a checkpoint, state carried over a rebuild) is moved to host memory."""

    def set(self, state: dict[str, Any]) -> None:
        device = self.key.device
        super().set({k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in state.items()})


class Host(Home):
    """fp32 masters, gradients and optimizer state of this rank's pieces in host memory (module docstring)."""

    def __init__(self, side: ModelSide, spec: OffloadSpec, copies: DeviceCopies, near: Home) -> None:
        super().__init__(side, copies)
        self.spec, self.device_copies = spec, copies
        #: the pieces before :attr:`split` (``ratio`` below 1): on the device, in a :class:`~.store.Resident` home
        self.near = near
        #: the shard's elements ``[0, split)`` stay on the device
        self.split = 0
        self._runs: list[Run] = []
        #: per run of the plan, its sub-group; per sub-group after the split, its pieces
        self._group_of: list[int] = []
        self._groups: list[list[Piece]] = []
        self._index: dict[Piece, int] = {}
        #: the unscale/clip factor the next step applies to the host gradients, a sub-group at a time
        self._factor = 1.0

    def plan(self, runs: Sequence[Run], numel: int, inner: Any) -> None:
        """Sub-groups of whole pieces; the first ``int((1 - ratio) * n)`` stay on the device, the gradient buffer
        in host memory holds the rest."""
        if inner is None:
            return  # inference: no optimizer, no masters
        self._runs = list(runs)
        groups = whole_sub_groups(self._runs, self.spec.sub_group_size)
        kept = int((1 - self.spec.ratio) * len(groups)) if self.spec.ratio < 1 else 0
        self.split = self._runs[groups[kept][0]].shard_offset if kept < len(groups) else numel
        self._group_of = [g for g, members in enumerate(groups) for _ in members]
        self._groups = [[] for _ in groups]
        self.device_copies.plan(self.split, numel - self.split)
        if self.spec.ratio < 1:
            logger.info(f"rank {self.spec.rank}: `zero_optimization.offload_optimizer.ratio: {self.spec.ratio}`: "
                        f"{self.split:,} of this rank's {numel:,} elements ({kept} of {len(groups)} sub-groups) keep "
                        "their fp32 masters and optimizer state on the device, the others in host memory")

    def add(self, piece: Piece, initial: Optional[torch.Tensor]) -> None:
        self.pieces.append(piece)
        if piece.at < 0:
            return  # a frozen flat-stage parameter, kept whole by the store
        index = self._index[piece] = planned_index(piece, self._runs, len(self._index), self.spec.rank, "host buffers")
        if piece.at < self.split:
            self.near.add(piece, initial)
            return
        self._groups[self._group_of[index]].append(piece)
        if initial is not None:
            piece.key = self.start(piece, initial)

    def start(self, piece: Piece, initial: torch.Tensor) -> torch.Tensor:
        return initial.to("cpu", torch.float32, copy=True)

    def apart(self, piece: Piece) -> bool:
        return piece.at >= self.split

    def master(self, piece: Piece) -> torch.Tensor:
        assert piece.key is not None
        return piece.key.detach().view(-1)

    def slot(self, piece: Piece, state: MutableMapping[Any, Any]) -> StateSlot:
        assert piece.key is not None
        return _PlacedSlot(state, piece.key) if self.apart(piece) else OptimizerSlot(state, piece.key)

    def freeze(self, piece: Piece, state: MutableMapping[Any, Any]) -> Kept:
        return self.near.freeze(piece, state)  # (the master and state as they are, wherever they are)

    def thaw(self, piece: Piece, kept: Optional[Kept], state: MutableMapping[Any, Any]) -> None:
        if not self.apart(piece):
            self.near.thaw(piece, kept, state)
            return
        master = kept.master if kept is not None else self.side.values(piece)
        piece.key = master.to("cpu", torch.float32)
        if kept is not None and kept.state:
            self.slot(piece, state).set(kept.state)

    def scale(self, factor: float) -> None:
        """The device's gradients now; the host's as each sub-group steps (no pass of its own over them)."""
        near = [p.key.grad for p in self.near.pieces if p.key is not None and p.key.grad is not None]
        if near:  # (the flat stages' device share shares its buffer, and version counter, with what is copied)
            self.device_copies.wait()
            torch._foreach_mul_(near, factor)
            self.device_copies.restamp()
        self._factor *= factor

    def step(self, inner: Any) -> None:
        """The device's sub-groups, then each host sub-group: scaled, stepped (fused on the CPU), published."""
        self.device_copies.wait()
        factor, self._factor = self._factor, 1.0
        near = [p for p in self.near.pieces if p.key is not None and p.key.grad is not None]
        if near:
            _step(inner, near)
            self.near.publish()
        for pieces in self._groups:
            stepped = [p for p in pieces if p.key is not None and p.key.grad is not None]
            if not stepped:
                continue
            with fused_on_host(inner), _scaled_in_step(inner, stepped, factor):
                _step(inner, stepped)
            self.device_copies.publish(self.side.write, [(p, 0, self.master(p)) for p in stepped])
        self.side.settle()

    def publish(self) -> None:
        self.near.publish()
        runs = [(p, 0, self.master(p)) for pieces in self._groups for p in pieces if p.key is not None]
        self.device_copies.publish(self.side.write, runs)
        self.side.settle()

    def nbytes(self) -> int:
        """Bytes of the masters apart from the model (either side of the split) and the copies' buffers."""
        host = sum(p.key.numel() * 4 for pieces in self._groups for p in pieces if p.key is not None)
        return self.near.nbytes() + host + self.device_copies.nbytes()


def _step(inner: Any, pieces: Sequence[Piece]) -> None:
    """``inner.step()`` over ``pieces``' keys only (each in its param group)."""
    params: list[list[torch.Tensor]] = [[] for _ in inner.param_groups]
    for piece in pieces:
        assert piece.key is not None
        params[piece.group].append(piece.key)
    with stepping_only(inner, params):
        inner.step()
