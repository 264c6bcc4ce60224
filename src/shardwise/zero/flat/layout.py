"""How trainable parameters are laid out in flat buckets and split across ranks (docs/zero.md, "How partitions are
laid out").

Parameters are packed in reverse registration order into buckets of about ``reduce_bucket_size`` elements, each padded
to a multiple of the number of shards and split into equal contiguous slices: rank ``r`` owns slice ``r`` of *every*
bucket.  This rank's *shard* is its slices of all buckets; a :class:`Piece` is the part of one parameter inside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

__all__ = ["Bucket", "FlatLayout", "Piece"]


@dataclass(frozen=True)
class Piece:
    """The elements ``[start, end)`` of parameter ``param`` (flattened) owned here.

    ``shard_offset`` is where they sit in this rank's flat shard.
    """

    param: int
    start: int
    end: int
    shard_offset: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass
class Bucket:
    """A run of whole parameters reduced and gathered as one flat tensor."""

    index: int
    dtype: torch.dtype
    params: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    padded: int = 0
    shard_numel: int = 0
    shard_offset: int = 0
    flat_offset: int = 0

    def add(self, param: int, numel: int) -> None:
        self.params.append(param)
        self.offsets.append(self.numel)
        self.numel += numel


class FlatLayout:
    """Buckets over ``params`` split into ``num_shards`` equal slices; this rank is ``rank``."""

    def __init__(self, params: Sequence[torch.Tensor], bucket_numel: int, num_shards: int, rank: int) -> None:
        self.params = list(params)
        self.num_shards, self.rank = num_shards, rank
        self.buckets = _make_buckets(params, bucket_numel)
        self.shard_numel = self._assign_shards()
        self.pieces = self._pieces()
        self.bucket_of: dict[int, tuple[Bucket, int]] = {
            p: (b, off) for b in self.buckets for p, off in zip(b.params, b.offsets)
        }

    @property
    def numel(self) -> int:
        """Trainable elements, without padding."""
        return sum(b.numel for b in self.buckets)

    @property
    def padded_numel(self) -> int:
        return sum(b.padded for b in self.buckets)

    def _assign_shards(self) -> int:
        offset = flat = 0
        for bucket in self.buckets:
            bucket.padded = -(-bucket.numel // self.num_shards) * self.num_shards
            bucket.shard_numel = bucket.padded // self.num_shards
            bucket.shard_offset, bucket.flat_offset = offset, flat
            offset += bucket.shard_numel
            flat += bucket.padded
        return offset

    def _pieces(self) -> list[Piece]:
        pieces = []
        for bucket in self.buckets:
            lo = self.rank * bucket.shard_numel
            hi = lo + bucket.shard_numel
            for param, off in zip(bucket.params, bucket.offsets):
                start = max(lo, off)
                end = min(hi, off + self.params[param].numel())
                if start < end:
                    shard_at = bucket.shard_offset + start - lo
                    pieces.append(Piece(param, start - off, end - off, shard_at))
        return pieces

    def shard_slice(self, flat: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        """This rank's slice of ``bucket`` inside a shard-sized flat tensor."""
        return flat.narrow(0, bucket.shard_offset, bucket.shard_numel)

    def bucket_slice(self, flat: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        """``bucket``'s region of a full-size (padded) flat tensor."""
        return flat.narrow(0, bucket.flat_offset, bucket.padded)

    def owned_slice(self, flat: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        """This rank's slice of ``bucket`` inside a full-size (padded) flat tensor."""
        return flat.narrow(0, bucket.flat_offset + self.rank * bucket.shard_numel, bucket.shard_numel)

    def param_slice(self, flat: torch.Tensor, param: int) -> torch.Tensor:
        """Parameter ``param``'s elements inside a full-size (padded) flat tensor."""
        bucket, offset = self.bucket_of[param]
        return flat.narrow(0, bucket.flat_offset + offset, self.params[param].numel())


#: elements of the first and the last bucket reduced: 1 MiB of fp32, as DDP's first bucket. The first
#: starts communication early in backward; the last is what backward's end must still wait for.
EDGE_BUCKET = 1 << 18


def _make_buckets(params: Sequence[torch.Tensor], bucket_numel: int) -> list[Bucket]:
    """Buckets in reverse registration order; the first and the last hold at most ``EDGE_BUCKET`` elements
    (or one parameter, when a parameter alone is larger)."""
    edge = min(EDGE_BUCKET, bucket_numel)
    tail, total = 0, 0  # how many parameters from the front (registered first: their gradients arrive last) fit in `edge`
    while tail < len(params) and (tail == 0 or total + params[tail].numel() <= edge):
        total += params[tail].numel()
        tail += 1
    buckets: list[Bucket] = []
    for index in reversed(range(len(params))):
        param = params[index]
        current = buckets[-1] if buckets else None
        limit = edge if len(buckets) == 1 else bucket_numel
        fits = current is not None and current.numel + param.numel() <= limit and (index < tail) == (
            current.params[-1] < tail)
        if current is None or not fits or current.dtype != param.dtype:
            current = Bucket(index=len(buckets), dtype=param.dtype)
            buckets.append(current)
        current.add(index, param.numel())
    return buckets

