"""Stage 1: optimizer state and fp32 master weights sharded across ranks.

Gradients stay full-size on every rank (a flat buffer ``param.grad`` views
into); at the accumulation boundary each bucket is reduce-scattered, so a rank
receives the averaged gradient of exactly the slice it owns, steps that slice,
and all-gathers the updated parameters (:meth:`.FlatStrategy._regather`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..distributed import Work
from .flat import FlatStrategy

__all__ = ["Stage1", "uses_reduce_scatter"]


def uses_reduce_scatter(setting: Optional[bool], backend: str, shared_memory: bool = False) -> bool:
    """How stages 1-2 average gradients: DeepSpeed's ``reduce_scatter`` when set, else by transport.

    gloo's reduce-scatter over sockets takes ~1.8x its all-reduce of the same bucket (measured at 40M
    parameters, docs/benchmarks.md), so there the all-reduce wins despite sending twice the bytes.  Through
    shared memory (:mod:`shardwise.shm`) and on NCCL the reduce-scatter is the cheaper one (20 MB, 2 ranks,
    shared memory: 4.2 against 5.4 ms).
    """
    if setting is not None:
        return setting
    return backend != "gloo" or shared_memory


class Stage1(FlatStrategy):
    """Sharded master weights and optimizer state; full gradients."""

    stage = 1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reduce_scatter = uses_reduce_scatter(self.zero_config.reduce_scatter, self.comm.backend,
                                                  self.comm.shm.active)

    def describe_reduction(self) -> str:
        how = "reduce-scatter" if self.reduce_scatter else "all-reduce, keeping this rank's slice"
        why = "as configured" if self.zero_config.reduce_scatter is not None else f"chosen for {self.comm.shm.name(self.comm.backend)}"
        return f"gradients averaged by {how} ({why}: `zero_optimization.reduce_scatter`)"

    def _reduce(self, source: torch.Tensor, output: torch.Tensor) -> tuple[Work, Optional[torch.Tensor]]:
        if source.dtype != output.dtype:
            source = source.to(output.dtype)  # bf16/fp16 gradients averaged in fp32
        if not self.reduce_scatter:
            # Twice the bytes of a reduce-scatter, then the owned slice is kept.
            return self.comm.all_reduce(source, async_op=True), source
        return self.comm.reduce_scatter(output, source, async_op=True), None
