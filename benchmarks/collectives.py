"""The α-β cost of the ring collectives ZeRO uses, per rank.

A link is described by a latency α (seconds per message hop) and an inverse
bandwidth β (seconds per byte).  With N ranks and a full-size tensor of S
bytes, the ring algorithms (Thakur, Rabenseifner and Gropp 2005; Patarasuk and
Yuan 2009) take

* reduce-scatter and all-gather: (N−1)·α + (N−1)/N · S · β
* all-reduce (= reduce-scatter + all-gather): 2(N−1)·α + 2(N−1)/N · S · β

so the byte terms match what ``shardwise.comm.distributed.Comm`` counts.  A job that
sends a collective as B buckets pays the latency term B times.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Link", "all_gather", "all_reduce", "reduce_scatter"]


@dataclass(frozen=True)
class Link:
    """Latency ``alpha`` (s) and inverse bandwidth ``beta`` (s/byte) of one ring hop; where the figures come from."""

    name: str
    alpha: float
    beta: float
    source: str

    @property
    def gbytes_per_s(self) -> float:
        return 1.0 / self.beta / 1e9


def _share(n: int) -> float:
    return (n - 1) / n


def reduce_scatter(nbytes: float, n: int, link: Link, buckets: int = 1) -> float:
    """Seconds to reduce-scatter a full-size ``nbytes`` tensor over ``n`` ranks in ``buckets`` pieces."""
    if n <= 1:
        return 0.0
    return buckets * (n - 1) * link.alpha + _share(n) * nbytes * link.beta


def all_gather(nbytes: float, n: int, link: Link, buckets: int = 1) -> float:
    """Seconds to all-gather into a full-size ``nbytes`` tensor over ``n`` ranks (same cost as reduce-scatter)."""
    return reduce_scatter(nbytes, n, link, buckets)


def all_reduce(nbytes: float, n: int, link: Link, buckets: int = 1) -> float:
    """Seconds to all-reduce ``nbytes`` over ``n`` ranks: a reduce-scatter then an all-gather."""
    return reduce_scatter(nbytes, n, link, buckets) + all_gather(nbytes, n, link, buckets)
