"""The optimizer step shared by every stage: overflow check, unscale, clip, step, re-gather."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

from ..comm.distributed import Comm
from ..optim.optimizers import ShardwiseOptimizer
from ..optim.precision import Precision
from .base import Strategy

__all__ = ["ZeroOptimizer"]


class ZeroOptimizer(ShardwiseOptimizer):
    """Steps the inner optimizer over the master weights a ZeRO stage keeps.

    One all-reduce (the squared gradient norm, for sharded gradients, with
    stage 3's "had a gradient" flags beside it) serves both clipping and
    overflow detection: an inf or NaN anywhere makes the global sum non-finite
    on every rank, so all ranks skip the same step.  The strategy is asked twice: for this rank's terms of the
    sums (the norm's share, without a pipeline stage's tied copies counted
    on another stage: ``FlatStrategy.count_elsewhere``; stage 3's "had a
    gradient" flags ride along), and for the step itself with the factor that unscales and
    clips.
    """

    def __init__(
        self,
        inner: Any,
        strategy: Strategy,
        precision: Precision,
        comm: Comm,
        clip: float,
        model_parallel_comm: Optional[Comm] = None,
    ) -> None:
        super().__init__(inner)
        self.strategy = strategy
        self.precision = precision
        self.comm = comm
        self.clip = clip
        #: ranks holding *other* parameters of the same model (pipeline stages): the
        #: squared norm is summed over them too, so clipping and overflow are global
        self.model_parallel_comm = model_parallel_comm
        #: global L2 norm of the (unscaled) gradients at the last step; inf on overflow; None before
        self.last_grad_norm: Optional[float] = None

    def step(self, closure: Optional[Callable[[], Any]] = None, *, zero_grad: bool = False) -> bool:  # type: ignore[override]
        """Apply the update; returns False when it was skipped for overflow.  ``zero_grad``: the gradients are
        dropped in the same call (``engine.step()``, as DeepSpeed's; a script's own ``optimizer.step()`` keeps
        them, as torch's does)."""
        if closure is not None:
            raise ValueError("closures are not supported: run forward/backward through the engine instead")
        scale = self.precision.scaler.current
        sums = self.strategy.step_sums()
        if self.strategy.shards_grads:
            self.comm.all_reduce(sums)
        if self.model_parallel_comm is not None:
            self.model_parallel_comm.all_reduce(sums[:1])  # the norm only: the rest count this group's ranks
        norm_sq = float(sums[0].item())
        if not math.isfinite(norm_sq):
            self.last_grad_norm = math.inf
            self.precision.scaler.update(overflow=True)
            if zero_grad:
                self.strategy.zero_grad()
            return False
        self.last_grad_norm = math.sqrt(norm_sq) / scale
        factor = 1.0 / scale
        if self.clip > 0:
            # torch.nn.utils.clip_grad_norm_'s rule, so results match it exactly
            factor *= min(1.0, self.clip / (self.last_grad_norm + 1e-6))
        # scale, leave unused alone, step the masters, publish them (and drop the gradients)
        self.strategy.step(self.inner, factor, sums[1:], zero_grad)
        self.precision.scaler.update(overflow=False)
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.strategy.zero_grad()
