"""Stage 2: as stage 1, and gradients sharded too.

No full-size gradient buffer exists (:class:`~.grads.StagedGrads`).  At the
accumulation boundary each parameter's gradient is copied (in fp32) into its
bucket's staging tensor the moment autograd produces it, and ``param.grad`` is
released; the bucket is reduce-scattered as soon as it is complete and its
staging freed once the collective finishes.  Between boundaries (gradient
accumulation, ``no_sync``) gradients accumulate in ``param.grad`` at full
size: accumulation trades that memory for communicating once per step.

It reduces and regathers as stage 1 does; only the gradient storage differs.
"""

from __future__ import annotations

from .grads import StagedGrads
from .stage1 import Stage1

__all__ = ["Stage2"]


class Stage2(Stage1):
    """Sharded master weights, optimizer state and gradients."""

    stage = 2
    grad_storage = StagedGrads
