"""What optimizer offload to NVMe was asked for, and how this rank's shard is cut into sub-groups.

A sub-group is a run of consecutive pieces (one parameter's part of this
rank's shard each) of at most ``sub_group_size`` elements; a piece larger than
that is a sub-group of its own, since the inner optimizer steps whole pieces
(their state is keyed by the tensor it steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from .layout import Piece

__all__ = ["OffloadSpec", "SubGroup", "offload_spec", "plan_sub_groups", "state_bytes_per_element"]

#: per-element bytes of optimizer state torch's optimizers keep (fp32); unknown optimizers count as Adam
_STATE_BYTES = {"Adam": 8, "AdamW": 8, "NAdam": 8, "RAdam": 8, "Adamax": 8, "Adadelta": 8, "Adagrad": 4}


@dataclass(frozen=True)
class OffloadSpec:
    """``offload_optimizer: {device: nvme, ...}`` and ``sub_group_size``, for one rank."""

    root: str
    buffer_count: int
    pin_memory: bool
    sub_group_size: int
    rank: int
    #: optimizer state bytes per element, for the free-space check before training
    state_bytes: int


@dataclass
class SubGroup:
    """Pieces ``pieces`` (indices into the layout's pieces) at ``offsets`` in a run of ``numel`` elements."""

    index: int
    pieces: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    numel: int = 0


def plan_sub_groups(pieces: Sequence[Piece], size: int) -> list[SubGroup]:
    groups: list[SubGroup] = []
    for index, piece in enumerate(pieces):
        if not groups or (groups[-1].numel and groups[-1].numel + piece.numel > size):
            groups.append(SubGroup(len(groups)))
        group = groups[-1]
        group.pieces.append(index)
        group.offsets.append(group.numel)
        group.numel += piece.numel
    return groups


def state_bytes_per_element(inner: Any) -> int:
    """Bytes of per-element state ``inner`` keeps (an estimate before its first step)."""
    name = type(inner).__name__
    groups = getattr(inner, "param_groups", [])
    if name == "SGD":
        return 4 if any(g.get("momentum", 0) for g in groups) else 0
    if name == "RMSprop":
        return 4 + 4 * any(g.get("momentum", 0) for g in groups) + 4 * any(g.get("centered") for g in groups)
    return _STATE_BYTES.get(name, 8) + 4 * any(g.get("amsgrad") for g in groups)


def offload_spec(zero_config: Any, rank: int, inner: Any) -> Optional[OffloadSpec]:
    """The spec when ``zero_config`` offloads the optimizer to NVMe, else None."""
    section = getattr(zero_config, "offload_optimizer", None)
    if section is None or section.device != "nvme":
        return None
    return OffloadSpec(str(section.nvme_path), section.buffer_count, section.pin_memory,
                       zero_config.sub_group_size, rank, state_bytes_per_element(inner))
