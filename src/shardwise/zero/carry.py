"""Carrying master weights and optimizer state across a rebuild of the flat layout.

When the set of trainable parameters changes, buckets and partitions are
rebuilt and every rank may own different element ranges than before.  Before
the rebuild, each parameter's fp32 master value and optimizer state are
re-assembled at full size (one all-gather per state kind); after it, each rank
slices out its new pieces.  Parameters that stop training keep their entry, so
unfreezing resumes exactly where they left off (Adam's ``step`` included).

The full-size copies are transient during the rebuild; the entries of frozen
parameters are kept replicated on every rank until they train again.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..distributed import Comm
from .layout import FlatLayout

__all__ = ["ParamState", "export_state", "import_state"]

#: ``{"master": full fp32 tensor, "tensors": {name: full tensor}, "scalars": {name: value}}``
ParamState = dict[str, Any]


def _is_piece_tensor(value: Any, key: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == key.numel()


def export_state(
    layout: FlatLayout,
    master: torch.Tensor,
    views: dict[int, torch.Tensor],
    state: Any,
    comm: Comm,
    gather_flat: Callable[[torch.Tensor], torch.Tensor],
) -> dict[int, ParamState]:
    """Full master and optimizer state of every parameter in ``layout`` (collective).

    ``views`` maps ``id(param)`` to the master piece the inner optimizer steps
    (absent where this rank owns none of that parameter).
    """
    result = _scalars(layout, views, state, comm)
    names = sorted({n for entry in result.values() for n in entry["names"]})
    for name in ["master", *names]:
        shard = master if name == "master" else _assemble(layout, master, views, state, name)
        full = gather_flat(shard)
        for index, param in enumerate(layout.params):
            entry = result[id(param)]
            if name == "master":
                entry["master"] = layout.param_slice(full, index).clone()
            elif name in entry["names"]:
                entry["tensors"][name] = layout.param_slice(full, index).clone()
    return result


def _assemble(layout: FlatLayout, master: torch.Tensor, views: dict[int, torch.Tensor], state: Any, name: str) -> torch.Tensor:
    shard = torch.zeros_like(master)
    for piece in layout.pieces:
        value = state.get(views[id(layout.params[piece.param])], {}).get(name)
        if value is not None:
            shard.narrow(0, piece.shard_offset, piece.numel).copy_(value)
    return shard


def _scalars(layout: FlatLayout, views: dict[int, torch.Tensor], state: Any, comm: Comm) -> dict[int, ParamState]:
    """Per parameter: its non-tensor state and the names of its per-element tensors.

    Every piece of a parameter is stepped together, so whichever rank owns a
    piece can speak for the whole parameter; one ``all_gather_object`` shares it.
    """
    local: dict[int, tuple[dict[str, Any], list[str]]] = {}
    for index, param in enumerate(layout.params):
        view = views.get(id(param))
        if view is None:
            continue
        entries = state.get(view)
        if entries:
            scalars = {k: _plain(v) for k, v in entries.items() if not _is_piece_tensor(v, view)}
            local[index] = (scalars, sorted(k for k, v in entries.items() if _is_piece_tensor(v, view)))
    result: dict[int, ParamState] = {id(p): {"tensors": {}, "scalars": {}, "names": []} for p in layout.params}
    for gathered in comm.all_gather_object(local):
        for index, (scalars, names) in gathered.items():
            result[id(layout.params[index])].update(scalars=scalars, names=names)
    return result


def _plain(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def import_state(
    layout: FlatLayout,
    views: dict[int, torch.Tensor],
    state: Any,
    carried: dict[int, ParamState],
) -> None:
    """Fill this rank's new master pieces and optimizer state from ``carried``."""
    for piece in layout.pieces:
        param = layout.params[piece.param]
        entry = carried.get(id(param))
        if entry is None:
            continue  # never trained before: master came from the parameter, state starts fresh
        view = views[id(param)]
        view.copy_(entry["master"].narrow(0, piece.start, piece.numel))
        if entry["tensors"] or entry["scalars"]:
            restored = {k: v.narrow(0, piece.start, piece.numel).clone() for k, v in entry["tensors"].items()}
            restored.update({k: _plain(v) for k, v in entry["scalars"].items()})
            state[view] = restored
