"""Stage 0: plain data parallel, done well.

Every rank holds everything.  Gradients live in one flat buffer that
``param.grad`` views into (as DDP's ``gradient_as_bucket_view``); each bucket
is all-reduced asynchronously as soon as autograd has filled it.  In fp32 the
model's own parameters are the master weights, so memory matches DDP; with one
shard the step writes every parameter itself, so there is nothing to regather.
"""

from __future__ import annotations

import functools

from .grads import Reduce, all_reduce_in_place
from .strategy import FlatStrategy

__all__ = ["Stage0"]


class Stage0(FlatStrategy):
    """Replicated parameters, gradients and optimizer state; bucketed all-reduce."""

    stage = 0

    def _num_shards(self) -> int:
        return 1

    def _reduction(self) -> Reduce:
        return functools.partial(all_reduce_in_place, self.comm)
