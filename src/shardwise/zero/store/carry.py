"""Carrying master weights and optimizer state across a rebuild of the flat layout.

When the trainable set changes, buckets and partitions are rebuilt and a rank may own other element ranges:
before, each parameter's fp32 master and optimizer state are re-assembled at full size (one all-gather per
state kind, :func:`export_state`); after, each rank slices out its new pieces (:meth:`.MasterStore.adopt`).
A parameter that stops training keeps its full entry in the :class:`~.frozen.FrozenStore`, so unfreezing
resumes exactly where it left off (Adam's ``step`` included).
"""

from __future__ import annotations

from typing import Any, Callable, MutableMapping

import torch

from ...comm.distributed import Comm
from ...optim.param_state import KeptSlot, copy_value, is_per_element
from ..flat.layout import FlatLayout
from .frozen import Kept
from .store import MasterStore

__all__ = ["export_state"]


def export_state(layout: FlatLayout, store: MasterStore, state: MutableMapping[Any, Any], comm: Comm,
                 gather_flat: Callable[[torch.Tensor], torch.Tensor], whole: bool, device: torch.device) -> dict[int, Kept]:
    """Full master and optimizer state of every parameter in ``layout`` (collective, gathered on ``device``),
    taken out of the inner optimizer's ``state``; ``whole``: every rank steps the parameters themselves (stage 0
    in fp32), whose entries are then the parameters' own values, nothing gathered or copied."""
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
    """Per parameter: its non-per-element state, and the names of its per-element tensors.

    Every piece of a parameter is stepped together, so whichever rank owns a
    piece can speak for the whole parameter; one ``all_gather_object`` shares it.
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
