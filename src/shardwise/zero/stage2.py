"""Stage 2: as stage 1, and gradients sharded too.

No full-size gradient buffer exists.  At the accumulation boundary each
parameter's gradient is copied (in fp32) into its bucket's staging tensor the
moment autograd produces it, and ``param.grad`` is released; the bucket is
reduce-scattered as soon as it is complete and its staging freed once the
collective finishes.  Between boundaries (gradient accumulation, ``no_sync``)
gradients accumulate in ``param.grad`` at full size: accumulation trades that
memory for communicating once per step.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import tensor_bytes
from .layout import Bucket
from .masters import ReducedGrads
from .stage1 import Stage1

__all__ = ["Stage2"]


class Stage2(Stage1):
    """Sharded master weights, optimizer state and gradients."""

    stage = 2
    grads_in_params = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._staging: dict[int, torch.Tensor] = {}

    def _make_grad_storage(self) -> None:
        self.reduced = ReducedGrads.separate(self.layout, self.device)

    def _accumulate(self, index: int, param: torch.Tensor) -> None:
        pass  # between boundaries gradients accumulate in `param.grad`, where autograd puts them

    def _stage(self, bucket: Bucket) -> torch.Tensor:
        staging = self._staging.get(bucket.index)
        if staging is None:
            # `_capture` writes every parameter's slice (its gradient, or zeros) before the bucket is
            # reduced, so only the padding is zeroed here: no memset of the whole bucket every step
            staging = torch.empty(bucket.padded, dtype=torch.float32, device=self.device)
            staging[bucket.numel :].zero_()
            self._staging[bucket.index] = staging
        return staging

    def _capture(self, index: int, param: torch.Tensor) -> None:
        self._take_unseen(index, param)

    def _take_unseen(self, index: int, param: torch.Tensor) -> bool:
        bucket, offset = self.layout.bucket_of[index]
        target = self._stage(bucket).narrow(0, offset, param.numel())
        if param.grad is None:
            target.zero_()  # no gradient since it was cleared: zeros for the sum, and not used here
            return False
        target.copy_(param.grad.reshape(-1))
        param.grad = None  # the full-size gradient is no longer needed
        return True

    def _comm_input(self, bucket: Bucket) -> torch.Tensor:
        return self._stage(bucket)

    def finish_backward(self) -> None:
        super().finish_backward()
        if self.sync:
            self._staging.clear()

    def zero_grad(self) -> None:
        self._dirty = False
        for param in self.layout.params:
            param.grad = None  # not a use of the values: no wait for a gather in flight (see .pending)

    def memory_breakdown(self) -> dict[str, int]:
        counts = super().memory_breakdown()
        counts["gradients"] += tensor_bytes([p.grad for p in self.layout.params if p.grad is not None])
        return counts
