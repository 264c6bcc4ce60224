"""Stage 0: plain data parallel, done well.

Every rank holds everything.  Gradients live in one flat buffer that
``param.grad`` views into (as DDP's ``gradient_as_bucket_view``); each bucket
is all-reduced asynchronously as soon as autograd has filled it.  In fp32 the
model's own parameters are the master weights, so memory matches DDP; with one
shard the step writes every parameter itself, so there is nothing to regather.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..distributed import Work
from .flat import FlatStrategy

__all__ = ["Stage0"]


class Stage0(FlatStrategy):
    """Replicated parameters, gradients and optimizer state; bucketed all-reduce."""

    stage = 0

    def _num_shards(self) -> int:
        return 1

    def _reduce(self, source: torch.Tensor, output: torch.Tensor) -> tuple[Work, Optional[torch.Tensor]]:
        if source.data_ptr() != output.data_ptr():
            # bf16/fp16: the bucket cast once, straight into the fp32 slice the optimizer reads, averaged there
            output.copy_(source)
        return self.comm.all_reduce(output, async_op=True), None
