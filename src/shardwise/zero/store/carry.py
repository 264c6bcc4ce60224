"""Carrying master weights and optimizer state across a rebuild of the flat layout.

When the set of trainable parameters changes, buckets and partitions are
rebuilt and every rank may own different element ranges than before.  Before
the rebuild, each parameter's fp32 master value and optimizer state are
re-assembled at full size (one all-gather per state kind); after it, each rank
slices out its new pieces.  Parameters that stop training keep their full
entry in the :class:`~.frozen.FrozenStore`, so unfreezing resumes exactly where
they left off (Adam's ``step`` included).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, MutableMapping

import torch

from ...distributed import Comm
from ...param_state import KeptSlot, OptimizerSlot, copy_value, is_per_element
from ..layout import FlatLayout
from .frozen import Kept

__all__ = ["export_state", "import_state"]


def export_state(
    layout: FlatLayout,
    master: torch.Tensor,
    views: Mapping[int, torch.Tensor],
    state: Mapping[Any, Any],
    comm: Comm,
    gather_flat: Callable[[torch.Tensor], torch.Tensor],
) -> dict[int, Kept]:
    """Full master and optimizer state of every parameter in ``layout`` (collective).

    ``master`` is this rank's contiguous master shard; ``views`` maps
    ``id(param)`` to the master piece the inner optimizer steps (absent where
    this rank owns none of that parameter).
    """
    scalars, names = _scalars(layout, views, state, comm)
    result: dict[int, Kept] = {}
    full = gather_flat(master)
    for index, param in enumerate(layout.params):
        entry = Kept(0, param.numel(), layout.param_slice(full, index).clone(), KeptSlot(dict(scalars[index])))
        result[id(param)] = entry
    for name in sorted({n for per_param in names for n in per_param}):
        full = gather_flat(_assemble(layout, master, views, state, name))
        for index, param in enumerate(layout.params):
            if name in names[index]:
                result[id(param)].state[name] = layout.param_slice(full, index).clone()
    return result


def _assemble(layout: FlatLayout, master: torch.Tensor, views: Mapping[int, torch.Tensor], state: Mapping[Any, Any],
              name: str) -> torch.Tensor:
    shard = torch.zeros_like(master)
    for piece in layout.pieces:
        value = state.get(views[id(layout.params[piece.param])], {}).get(name)
        if value is not None:
            shard.narrow(0, piece.shard_offset, piece.numel).copy_(value.reshape(-1))
    return shard


def _scalars(layout: FlatLayout, views: Mapping[int, torch.Tensor], state: Mapping[Any, Any],
             comm: Comm) -> tuple[list[dict[str, Any]], list[list[str]]]:
    """Per parameter: its non-per-element state, and the names of its per-element tensors.

    Every piece of a parameter is stepped together, so whichever rank owns a
    piece can speak for the whole parameter; one ``all_gather_object`` shares it.
    """
    local: dict[int, tuple[dict[str, Any], list[str]]] = {}
    for index, param in enumerate(layout.params):
        view = views.get(id(param))
        entries = state.get(view) if view is not None else None
        if view is not None and entries:
            numel = view.numel()
            local[index] = (
                {k: copy_value(v) for k, v in entries.items() if not is_per_element(v, numel)},
                sorted(k for k, v in entries.items() if is_per_element(v, numel)),
            )
    scalars: list[dict[str, Any]] = [{} for _ in layout.params]
    names: list[list[str]] = [[] for _ in layout.params]
    for gathered in comm.all_gather_object(local):
        for index, (values, per_element) in gathered.items():
            scalars[index], names[index] = values, per_element
    return scalars, names


def import_state(
    layout: FlatLayout,
    views: Mapping[int, torch.Tensor],
    state: MutableMapping[Any, Any],
    carried: Mapping[int, Kept],
) -> None:
    """Fill this rank's new master pieces and optimizer state from ``carried``."""
    for piece in layout.pieces:
        param = layout.params[piece.param]
        entry = carried.get(id(param))
        if entry is None:
            continue  # never trained before: master came from the parameter, state starts fresh
        mine = entry.piece(piece.start, piece.end)
        view = views[id(param)]
        view.copy_(mine.master)
        if mine.state:
            OptimizerSlot(state, view).set(mine.state)
