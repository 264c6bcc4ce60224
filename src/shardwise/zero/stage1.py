"""Stage 1: optimizer state and fp32 master weights sharded across ranks.

Gradients stay full-size on every rank (a flat buffer ``param.grad`` views
into); at the accumulation boundary each bucket is reduce-scattered, so a rank
receives the averaged gradient of exactly the slice it owns, steps that slice,
and all-gathers the updated parameters.
"""

from __future__ import annotations

from .flat import FlatStrategy

__all__ = ["Stage1"]


class Stage1(FlatStrategy):
    """Sharded master weights and optimizer state; full gradients."""

    stage = 1
    persistent_grads = True
