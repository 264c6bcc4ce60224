"""Stage 1: optimizer state and fp32 master weights sharded across ranks.

Gradients stay full-size on every rank (a flat buffer ``param.grad`` views
into); at the accumulation boundary each bucket is reduce-scattered, so a rank
receives the averaged gradient of exactly the slice it owns, steps that slice,
and all-gathers the updated parameters (:meth:`.FlatStrategy._regather`).
"""

from __future__ import annotations

import functools
from typing import Optional

from .grads import Reduce, all_reduce_keeping_slice, reduce_scatter_slice
from .strategy import FlatStrategy

__all__ = ["Stage1", "uses_reduce_scatter"]


def uses_reduce_scatter(setting: Optional[bool], backend: str, shared_memory: bool = False) -> bool:
    """How stages 1-2 average gradients: DeepSpeed's ``reduce_scatter`` when set, else by transport.

    gloo's reduce-scatter over sockets takes ~1.8x its all-reduce of the same bucket (measured at 40M
    parameters, docs/benchmarks.md), so there the all-reduce wins despite sending twice the bytes.  Through
    shared memory (:mod:`shardwise.comm.shm`) and on NCCL the reduce-scatter is the cheaper one (20 MB, 2 ranks,
    shared memory: 4.2 against 5.4 ms).
    """
    if setting is not None:
        return setting
    return backend != "gloo" or shared_memory


class Stage1(FlatStrategy):
    """Sharded master weights and optimizer state; full gradients."""

    stage = 1

    @property
    def reduce_scatter(self) -> bool:
        """Whether buckets are reduce-scattered (else all-reduced, this rank's slice kept)."""
        return uses_reduce_scatter(self.zero_config.reduce_scatter, self.comm.backend, self.comm.shm.active)

    def describe_reduction(self) -> str:
        how = "reduce-scatter" if self.reduce_scatter else "all-reduce, keeping this rank's slice"
        why = "as configured" if self.zero_config.reduce_scatter is not None else f"chosen for {self.comm.shm.name(self.comm.backend)}"
        return f"gradients averaged by {how} ({why}: `zero_optimization.reduce_scatter`)"

    def _reduction(self) -> Reduce:
        return functools.partial(reduce_scatter_slice if self.reduce_scatter else all_reduce_keeping_slice, self.comm)
