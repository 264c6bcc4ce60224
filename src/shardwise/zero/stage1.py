"""Stage 1: optimizer state and fp32 master weights sharded across ranks.

Gradients stay full-size on every rank (a flat buffer ``param.grad`` views
into); at the accumulation boundary each bucket is reduce-scattered, so a rank
receives the averaged gradient of exactly the slice it owns, steps that slice,
and all-gathers the updated parameters.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..distributed import Work
from .flat import FlatStrategy

__all__ = ["Stage1"]


class Stage1(FlatStrategy):
    """Sharded master weights and optimizer state; full gradients."""

    stage = 1

    def _reduce(self, source: torch.Tensor, output: torch.Tensor) -> tuple[Work, Optional[torch.Tensor]]:
        if not self.zero_config.reduce_scatter:
            # DeepSpeed's `reduce_scatter: false`: average with an all-reduce (twice the bytes, but
            # faster than gloo's reduce-scatter on CPU), then keep the owned slice.
            return self.comm.all_reduce(source, async_op=True), output
        return self.comm.reduce_scatter(output, source, async_op=True), None

    def _regather(self) -> None:
        # in fp32 each source is a slice of its output: the gather runs in place
        works = [self.comm.all_gather(region, master, async_op=True) for region, master in self.masters.gather_pairs()]
        for work in works:
            work.wait()
