"""What optimizer offload was asked for (to NVMe, or to host memory from an accelerator), and how this rank's
shard is cut into sub-groups.

A sub-group is a run of at most ``sub_group_size`` consecutive elements of the shard, cut into chunks
(:class:`Chunk`) where it meets the pieces; a piece larger than ``sub_group_size`` spans several.  The inner
optimizer steps one chunk as one tensor: an element-wise optimizer gives the same values however its tensors
are cut, as sharding already relies on.  ``ratio`` below 1 keeps the first sub-groups in host memory
(:func:`resident_split`): the files hold the elements after the split only.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import torch

from ..flat.layout import Piece

__all__ = ["Chunk", "OffloadSpec", "SubGroup", "moves_to_host", "offload_spec", "plan_sub_groups", "resident_split",
           "say_split", "state_bytes_per_element", "host_path_on_cpu", "whole_sub_groups"]

logger = logging.getLogger("shardwise")

#: per-element bytes of optimizer state torch's optimizers keep (fp32); unknown optimizers count as Adam
_STATE_BYTES = {"Adam": 8, "AdamW": 8, "NAdam": 8, "RAdam": 8, "Adamax": 8, "Adadelta": 8, "Adagrad": 4}


@dataclass(frozen=True)
class OffloadSpec:
    """``offload_optimizer: {device: cpu|nvme, ...}`` and ``sub_group_size``, for one rank."""

    root: str
    buffer_count: int
    pin_memory: bool
    sub_group_size: int
    rank: int
    #: the share of the sub-groups whose state is offloaded (``offload_optimizer.ratio``); the others stay in memory
    #: (NVMe: in host memory; ``cpu``: on the device, as DeepSpeed's partial offload)
    ratio: float = 1.0
    #: ``nvme`` (files under ``root``) or ``cpu`` (host memory, a job on an accelerator)
    device: str = "nvme"
    #: whether gradients and updated values cross between the model's device and host memory (a job on an
    #: accelerator, or a CPU job under :func:`host_path_on_cpu`); NVMe on a CPU job steps the model's own memory
    copies: bool = False


@dataclass(frozen=True)
class Chunk:
    """Elements ``[at, at + numel)`` of piece ``piece``, at ``shard_at`` in this rank's shard."""

    piece: int
    at: int
    numel: int
    shard_at: int


@dataclass
class SubGroup:
    """Chunks ``chunks`` (indices) inside the shard's elements ``[start, end)``."""

    index: int
    chunks: list[int] = field(default_factory=list)
    start: int = 0
    end: int = 0

    @property
    def numel(self) -> int:
        return self.end - self.start


def plan_sub_groups(pieces: Sequence[Piece], size: int, split: int = 0) -> tuple[list[Chunk], list[SubGroup]]:
    """The chunks of ``pieces`` and the sub-groups of at most ``size`` elements they fall into, in shard order;
    a sub-group also starts at the piece that starts at element ``split`` (none spans the resident split)."""
    chunks: list[Chunk] = []
    groups: list[SubGroup] = []
    filled = size
    for index, piece in enumerate(pieces):
        if split and piece.shard_offset == split:
            filled = size
        at = 0
        while at < piece.numel:
            if filled >= size:
                groups.append(SubGroup(len(groups), start=piece.shard_offset + at))
                filled = 0
            numel = min(piece.numel - at, size - filled)
            chunks.append(Chunk(index, at, numel, piece.shard_offset + at))
            groups[-1].chunks.append(len(chunks) - 1)
            groups[-1].end = piece.shard_offset + at + numel
            filled += numel
            at += numel
    return chunks, groups


def resident_split(pieces: Sequence[Piece], size: int, ratio: float) -> int:
    """The shard elements ``[0, split)`` whose master and state stay in host memory for ``ratio`` (the share offloaded).

    As DeepSpeed's partial offload: of the ``n`` sub-groups, the first ``int((1 - ratio) * n)`` stay.  DeepSpeed's
    sub-groups hold whole parameters; here a piece may span two, so where the split would cut a piece it moves
    back to that piece's start (the piece is offloaded whole): memory never holds more sub-groups than asked
    (the share is counted in sub-groups, as DeepSpeed's, so a short last sub-group weighs as much as a full one)."""
    if ratio >= 1:
        return 0
    _, groups = plan_sub_groups(pieces, size)
    kept = int((1 - ratio) * len(groups))
    if kept == 0:
        return 0
    if kept >= len(groups):
        return groups[-1].end
    split = groups[kept].start
    for piece in pieces:
        if piece.shard_offset < split < piece.shard_offset + piece.numel:
            return piece.shard_offset
    return split


def say_split(spec: OffloadSpec, resident: int, numel: int, groups: Sequence[SubGroup]) -> None:
    """An info line of what ``ratio`` below 1 keeps in host memory on this rank (the split may have moved)."""
    if spec.ratio >= 1:
        return
    kept = sum(1 for g in groups if g.end <= resident)
    logger.info(f"rank {spec.rank}: `zero_optimization.offload_optimizer.ratio: {spec.ratio}`: {resident:,} of this "
                f"rank's {numel:,} elements ({kept} of {len(groups)} sub-groups) keep their fp32 masters and optimizer "
                f"state in host memory, the other {numel - resident:,} are offloaded (the split is at a "
                "sub-group's start, moved back to a parameter's edge where it would cut one)")


def state_bytes_per_element(inner: Any) -> int:
    """Bytes of per-element state ``inner`` keeps (an estimate before its first step)."""
    name = type(inner).__name__
    groups = getattr(inner, "param_groups", [])
    if name == "SGD":
        return 4 if any(g.get("momentum", 0) for g in groups) else 0
    if name == "RMSprop":
        return 4 + 4 * any(g.get("momentum", 0) for g in groups) + 4 * any(g.get("centered") for g in groups)
    return _STATE_BYTES.get(name, 8) + 4 * any(g.get("amsgrad") for g in groups)


def whole_sub_groups(pieces: Sequence[Piece], size: int) -> list[list[int]]:
    """The pieces (indices, in shard order) of each sub-group of at most ``size`` elements made of whole pieces,
    as DeepSpeed's: a piece larger than ``size`` is a sub-group of its own (the host home steps pieces whole)."""
    groups: list[list[int]] = []
    filled = size
    for index, piece in enumerate(pieces):
        if filled + piece.numel > size or not groups:
            groups.append([])
            filled = 0
        groups[-1].append(index)
        filled += piece.numel
    return groups


_host_path = False


@contextlib.contextmanager
def host_path_on_cpu() -> Iterator[None]:
    """For the CPU suite: engines initialized inside take the host path on a CPU job as on an accelerator
    (``offload_optimizer``/``offload_param: {device: cpu}`` act, with host buffers apart from the model's and the
    copies between them), so every line but the device copies themselves runs without a GPU."""
    global _host_path
    before, _host_path = _host_path, True
    try:
        yield
    finally:
        _host_path = before


def moves_to_host(device: torch.device) -> bool:
    """Whether offload to ``cpu`` moves anything for a model on ``device``: on an accelerator it does; on a CPU job
    the state is in host memory already (unless :func:`host_path_on_cpu` is on)."""
    return device.type != "cpu" or _host_path


def offload_spec(zero_config: Any, rank: int, device: torch.device) -> Optional[OffloadSpec]:
    """The spec when ``zero_config`` offloads the optimizer for a model on ``device``: to NVMe, or to host memory
    where that moves it (:func:`moves_to_host`); else None."""
    section = getattr(zero_config, "offload_optimizer", None)
    if section is None or (section.device == "cpu" and not moves_to_host(device)):
        return None
    return OffloadSpec(str(section.nvme_path or ""), section.buffer_count, section.pin_memory,
                       zero_config.sub_group_size, rank, float(section.ratio), section.device, moves_to_host(device))
