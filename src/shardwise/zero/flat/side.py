"""The flat stages' side of the master store: their parameters in one flat buffer, this rank's slice of it, and the
state carried across a rebuild of the layout.

For a :class:`~.layout.FlatLayout` the trainable parameters become views of one flat buffer of the compute dtype, so
this rank's slice of each bucket is where its updated values go and one all-gather per bucket, in place, brings the
others' (:meth:`FlatSide.gather_pairs`).  In fp32 that slice is the masters itself (the store's
:class:`~..store.store.Resident` home steps it in place).  With one shard and the gradients in ``param.grad`` (stage 0
in fp32) the parameters keep their own storage and are stepped themselves, as in DDP (:attr:`FlatSide.whole`).  A frozen
parameter keeps its own storage; the store keeps its master whole.

The all-gathers run behind the next forward (:class:`PendingGathers`).  torch's ``ZeroRedundancyOptimizer`` waits for
its broadcasts inside ``step()``; here ``step()`` returns at once and a bucket is waited for only when one of its
parameters is first used (any torch function on it: a forward, ``F.linear`` on a child's weight, ``state_dict()``,
``p.norm()``, ``.data``), so the first layers compute while later layers' values arrive.  While its bucket is in flight
a parameter's class is :class:`GatheringParameter`, whose ``__torch_function__`` waits for the bucket and makes its
parameters plain ``nn.Parameter`` again first. Reading or setting ``.grad`` and reading ``.requires_grad`` touch no
values and do not wait.  The strategy waits for everything itself before anything that writes parameters or masters
(backward, step, loading, changing the trainable set, closing).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterator, MutableMapping, Optional, Sequence

import torch
from torch import nn

from ...comm.distributed import Comm, Work, wait_all
from ...optim.param_state import KeptSlot, copy_value, is_per_element
from ..store.store import Kept, MasterStore, Piece, Runs
from .layout import FlatLayout

__all__ = ["FlatSide", "GatheringParameter", "PendingGathers", "export_state"]


class FlatSide:
    """The model's parameters for ``layout`` (see the module docstring); ``whole``: they are stepped themselves."""

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device, whole: bool) -> None:
        self.layout = layout
        self.whole = whole
        #: the model's flat parameter buffer (empty when the parameters are not flattened)
        self.param_flat = torch.empty(0)
        #: per trainable piece (by id), its elements of the model: fixed views, made with the pieces (a step
        #: writes through them without asking the layout again)
        self._regions: dict[int, torch.Tensor] = {}
        if not whole:
            self._flatten(dtype, device)

    def _flatten(self, dtype: torch.dtype, device: torch.device) -> None:
        """Move every trainable parameter into one flat buffer of ``dtype`` (they become views of it)."""
        layout = self.layout
        self.param_flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
        for index, param in enumerate(layout.params):
            view = layout.param_slice(self.param_flat, index)
            view.copy_(param.detach().reshape(-1))
            param.data = view.view_as(param)

    def pieces(self, names: dict[int, str], groups: dict[int, int], frozen: Sequence[nn.Parameter]) -> list[Piece]:
        """The store's pieces: this rank's part of each trainable parameter, in shard order, then each frozen
        parameter whole."""
        layout, pieces = self.layout, []
        for run in layout.pieces:
            param = layout.params[run.param]
            pieces.append(Piece(param, names[id(param)], param.shape, run.start, run.end, run.shard_offset,
                                groups[id(param)], run.param))
            if not self.whole:  # (whole: the parameter itself, which may not be contiguous, so not viewed flat)
                self._regions[id(pieces[-1])] = self._region(pieces[-1])
        for param in frozen:
            pieces.append(Piece(param, names[id(param)], param.shape, 0, param.numel(), -1, groups[id(param)], -1))
        return pieces

    def view(self, piece: Piece) -> Optional[torch.Tensor]:
        if piece.at < 0:
            return None  # frozen: its master is kept apart, whole
        return piece.param if self.whole else self._region(piece)

    def _region(self, piece: Piece) -> torch.Tensor:
        """The piece's elements of the model's parameter (in the flat buffer where it was flattened)."""
        if piece.at < 0 or self.whole:
            return piece.param.detach().view(-1).narrow(0, piece.start, piece.numel)
        return self.layout.param_slice(self.param_flat, piece.index).narrow(0, piece.start, piece.numel)

    def values(self, piece: Piece) -> torch.Tensor:
        return piece.param.detach().reshape(-1).narrow(0, piece.start, piece.numel).to(torch.float32, copy=True)

    def write(self, runs: Runs, last: bool = False) -> None:
        """Into this rank's slice of the flat buffer (then all-gathered), or a frozen parameter itself."""
        regions = self._regions
        for piece, at, values in runs:
            region = regions.get(id(piece))
            target = (region if region is not None else self._region(piece)).narrow(0, at, values.numel())
            if target.data_ptr() != values.data_ptr():
                target.copy_(values, non_blocking=True)  # from pinned staging (host offload): not waited for

    def settle(self) -> None:
        pass  # nothing is held between writes

    def gather_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per bucket: (the model's region of it, this rank's slice inside that region), fixed views; none with
        one shard (the step wrote every parameter).  After the step this rank's slice holds its updated values,
        so an all-gather of each pair, in place, re-assembles the updated parameters."""
        layout, flat = self.layout, self.param_flat
        if self.whole or layout.num_shards == 1:
            return []
        return [(layout.bucket_slice(flat, b), layout.owned_slice(flat, b)) for b in layout.buckets]

    def release(self) -> None:
        """Give every parameter its own storage again (before the layout is rebuilt)."""
        if not self.whole:
            for param in self.layout.params:
                param.data = param.data.clone()


def export_state(layout: FlatLayout, store: MasterStore, state: MutableMapping[Any, Any], comm: Comm,
                 gather_flat: Callable[[torch.Tensor], torch.Tensor], whole: bool, device: torch.device) -> dict[int, Kept]:
    """Full master and optimizer state of every parameter in ``layout`` (collective, gathered on ``device``),
    taken out of the inner optimizer's ``state``, before the layout is rebuilt for a new trainable set (a rank
    may own other element ranges after it; :meth:`.MasterStore.adopt` slices out its new pieces, and a parameter
    that stopped training keeps its full entry in the :class:`~..store.store.FrozenStore`).  One all-gather per
    state kind; ``whole``: every rank steps the parameters themselves (stage 0 in fp32), whose entries are then
    the parameters' own values, nothing gathered or copied."""
    store.home.check_whole("change the trainable set")
    pieces = [piece for piece in store.pieces if piece.key is not None]  # in the order of layout.pieces
    local = {run.param: store.home.slot(piece, state).get() for run, piece in zip(layout.pieces, pieces)}
    if whole:
        result = {id(p.param): Kept(0, p.numel, p.param.detach().view(-1), KeptSlot(local[p.index])) for p in pieces}
        state.clear()
        return result
    scalars, names = _scalars(layout, local, comm)
    master = store.shard(layout.shard_numel, device)
    full = gather_flat(master)
    result = {}
    for index, param in enumerate(layout.params):
        result[id(param)] = Kept(0, param.numel(), layout.param_slice(full, index).clone(), KeptSlot(dict(scalars[index])))
    for name in sorted({n for per_param in names for n in per_param}):
        shard = torch.zeros_like(master)
        for run in layout.pieces:
            value = local[run.param].get(name)
            if value is not None:
                shard.narrow(0, run.shard_offset, run.numel).copy_(value.reshape(-1))
        full = gather_flat(shard)
        for index, param in enumerate(layout.params):
            if name in names[index]:
                result[id(param)].state[name] = layout.param_slice(full, index).clone()
    state.clear()
    return result


def _scalars(layout: FlatLayout, local: dict[int, dict[str, Any]],
             comm: Comm) -> tuple[list[dict[str, Any]], list[list[str]]]:
    """Per parameter: its non-per-element state, and the names of its per-element tensors.  Every piece of a parameter
    is stepped together, so whichever rank owns a piece can speak for the whole parameter; one ``all_gather_object``
    shares it.
    """
    mine: dict[int, tuple[dict[str, Any], list[str]]] = {}
    for run in layout.pieces:
        entries = local[run.param]
        if entries:
            mine[run.param] = (
                {k: copy_value(v) for k, v in entries.items() if not is_per_element(v, run.numel)},
                sorted(k for k, v in entries.items() if is_per_element(v, run.numel)),
            )
    scalars: list[dict[str, Any]] = [{} for _ in layout.params]
    names: list[list[str]] = [[] for _ in layout.params]
    for gathered in comm.all_gather_object(mine):
        for index, (values, per_element) in gathered.items():
            scalars[index], names[index] = values, per_element
    return scalars, names


# ------------------------------------------------ the gathers behind the next forward
#: where a parameter in flight keeps (its PendingGathers, its bucket index)
_KEY = "_shardwise_gathering"


def _attribute(name: str) -> Any:
    """The descriptor behind ``Tensor.<name>``: what ``__torch_function__`` receives as ``func``."""
    return inspect.getattr_static(torch.Tensor, name)


#: what reads or sets a parameter's bookkeeping, not its values: these run without waiting
#: (``zero_grad`` and the trainable-set check touch every parameter while gathers are in flight)
_NOT_A_USE = frozenset({_attribute("grad").__get__, _attribute("grad").__set__, _attribute("requires_grad").__get__})


class GatheringParameter(nn.Parameter):
    """A parameter whose bucket's all-gather is still in flight (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Optional[dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if func not in _NOT_A_USE:
            for param in _in_flight(args, kwargs):
                param._arrive()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def _arrive(self) -> None:
        """Wait for this parameter's bucket (it and its bucket become plain Parameters)."""
        entry = self.__dict__.get(_KEY)
        if entry is not None:
            entry[0].wait_bucket(entry[1])

    # A copy or a pickle of a parameter in flight is of the arrived value, and a plain Parameter.
    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Parameter:
        self._arrive()
        return nn.Parameter.__deepcopy__(self, memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        self._arrive()
        return nn.Parameter.__reduce_ex__(self, protocol)


def _in_flight(args: Any, kwargs: dict[str, Any]) -> Iterator[GatheringParameter]:
    stack = [*args, *kwargs.values()]
    while stack:
        item = stack.pop()
        if type(item) is GatheringParameter:
            yield item
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


class PendingGathers:
    """The buckets whose all-gather was started and not yet waited for, with their parameters."""

    def __init__(self) -> None:
        #: per bucket in flight, its gather and its parameters (empty: nothing to wait for)
        self.works: dict[int, tuple[Work, list[torch.Tensor]]] = {}

    def start(self, gathers: Sequence[tuple[int, Work, list[torch.Tensor]]]) -> None:
        """Each ``(index, work, params)``: bucket ``index`` is being gathered by ``work`` into ``params``; guard
        them until it is done (one call for a step's buckets)."""
        for index, work, params in gathers:
            if any(type(p) is not nn.Parameter for p in params):
                work.wait()  # a Parameter subclass of the user's keeps its class: no overlap for its bucket
                continue
            self.works[index] = (work, params)
            for param in params:
                param.__dict__[_KEY] = (self, index)
                param.__class__ = GatheringParameter

    def wait_bucket(self, index: int) -> None:
        """Finish bucket ``index``'s gather (nothing if it is done); its parameters become plain again."""
        entry = self.works.pop(index, None)
        if entry is None:
            return
        work, params = entry
        _plain(params)
        work.wait()

    def wait_all(self) -> None:
        """Finish every gather in flight, in the order they were started."""
        entries, self.works = list(self.works.values()), {}
        for _, params in entries:
            _plain(params)
        wait_all([work for work, _ in entries])


def _plain(params: list[torch.Tensor]) -> None:
    """The parameters of a bucket whose gather is waited for become plain ``nn.Parameter`` s again."""
    for param in params:
        param.__class__ = nn.Parameter
        param.__dict__.pop(_KEY, None)
