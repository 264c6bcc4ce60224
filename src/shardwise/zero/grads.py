"""Where the flat stages keep gradients: chosen once per stage, beside the masters' arrangement.

Two storages, one class each:

* :class:`FlatGrads` (stages 0 and 1): one full-size flat buffer that
  ``param.grad`` views into, as DDP's ``gradient_as_bucket_view``; a bucket is
  reduced straight from its region of it.  The buffer comes from the allocator
  the strategy passes in: private memory, or memory every rank maps when the
  collectives go through shared memory (the reduction then reads in place).
* :class:`StagedGrads` (stage 2): no full-size buffer.  Between boundaries
  gradients accumulate in ``param.grad`` where autograd puts them; at a
  boundary each is copied (in fp32) into its bucket's staging tensor and
  released, and the staging goes once the bucket is reduced.

Each also says where this rank's averaged fp32 gradient lands
(:class:`ReducedGrads`: inside the full buffer when it is fp32, else a separate
shard) and whether ``param.grad`` holds the full-size gradient the masters may
step in place (:attr:`GradStorage.in_params`).

``param.grad`` is the truth, as in plain PyTorch: whatever cleared it (the
engine's ``zero_grad``, ``module.zero_grad()``, ``p.grad = None``) discarded
what the storage held, and autograd hands over a fresh tensor that holds
everything since; it is copied over the storage, never added.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Optional

import torch

from .base import tensor_bytes
from .layout import Bucket, FlatLayout

__all__ = ["Allocate", "FlatGrads", "GradStorage", "ReducedGrads", "StagedGrads", "private_zeros"]

#: ``allocate(numel, dtype, device)``: a zeroed flat tensor (collective when the memory is shared)
Allocate = Callable[[int, torch.dtype, torch.device], torch.Tensor]


def private_zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The allocator of this process's own memory."""
    return torch.zeros(numel, dtype=dtype, device=device)


class ReducedGrads:
    """Per bucket, where this rank's averaged fp32 gradient lands (what the optimizer reads)."""

    def __init__(self, slices: list[torch.Tensor], contiguous: Optional[torch.Tensor], owned: bool) -> None:
        self.slices = slices
        #: all of them as one tensor when they are contiguous (one kernel for the norm)
        self.contiguous = contiguous
        self._owned = owned

    @classmethod
    def in_buffer(cls, layout: FlatLayout, grad_flat: torch.Tensor) -> "ReducedGrads":
        """This rank's slices of the full fp32 gradient buffer (reduced in place)."""
        slices = [layout.owned_slice(grad_flat, b) for b in layout.buckets]
        return cls(slices, grad_flat if layout.num_shards == 1 else None, owned=False)

    @classmethod
    def separate(cls, layout: FlatLayout, device: torch.device) -> "ReducedGrads":
        """A separate fp32 shard."""
        shard = torch.zeros(layout.shard_numel, dtype=torch.float32, device=device)
        return cls([layout.shard_slice(shard, b) for b in layout.buckets], shard, owned=True)

    def bucket_sq(self, index: int) -> torch.Tensor:
        """Sum of squares of bucket ``index``'s slice (this rank's part)."""
        grad = self.slices[index].float()
        return torch.dot(grad, grad) if grad.numel() else grad.new_zeros(())

    def versions(self) -> tuple[int, ...]:
        """The slices' in-place write counters: a change means the gradients were written to."""
        return tuple(s._version for s in self.slices)

    def sq(self) -> torch.Tensor:
        """Sum of squares (this rank's part)."""
        if self.contiguous is not None:
            grad = self.contiguous.float()
            return torch.dot(grad, grad) if grad.numel() else grad.new_zeros(())
        if not self.slices:
            return torch.zeros((), dtype=torch.float32)
        return torch.stack([self.bucket_sq(index) for index in range(len(self.slices))]).sum()

    def scale(self, factor: float) -> None:
        if self.contiguous is not None:
            self.contiguous.mul_(factor)
        else:
            for grad in self.slices:
                grad.mul_(factor)

    def nbytes(self) -> int:
        """Bytes held apart from the full gradient buffer."""
        if not self._owned or self.contiguous is None:
            return 0
        return self.contiguous.numel() * self.contiguous.element_size()


class GradStorage(ABC):
    """This rank's gradients for a :class:`FlatLayout`, from autograd's hooks to the reduction."""

    #: whether ``param.grad`` holds the full-size gradient, averaged in place (the masters may be the params)
    in_params = False

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device, allocate: Allocate) -> None:
        self.layout = layout
        self.device = device
        self.reduced = ReducedGrads.separate(layout, device)

    @abstractmethod
    def on_grad(self, index: int, param: torch.Tensor, boundary: bool) -> None:
        """Autograd finished accumulating ``param``'s gradient; ``boundary``: the first time in a backward
        that reduces, so it goes where the reduction reads it (as :meth:`take` does)."""

    @abstractmethod
    def take(self, index: int, param: torch.Tensor) -> bool:
        """Before its bucket is reduced: put ``param``'s gradient where the reduction reads it (zeros when
        ``.grad`` is None: other ranks may have one to average with); whether it had one."""

    @abstractmethod
    def comm_input(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's summed local gradients as a full-size tensor, the reduction's input."""

    def reduced_all(self) -> None:
        """Every bucket's reduction has finished."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of gradients this rank holds."""


class FlatGrads(GradStorage):
    """One full-size flat buffer that ``param.grad`` views into (stages 0 and 1)."""

    in_params = True

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device, allocate: Allocate) -> None:
        self.layout = layout
        self.device = device
        self.flat = allocate(layout.padded_numel, dtype, device)
        # each parameter's gradient view, built once: every hook compares against it
        self._views = [layout.param_slice(self.flat, i).view_as(p) for i, p in enumerate(layout.params)]
        # fp32: the averages land in the buffer itself; fp16/bf16: in an fp32 shard of their own
        in_place = dtype == torch.float32
        self.reduced = ReducedGrads.in_buffer(layout, self.flat) if in_place else ReducedGrads.separate(layout, device)

    def on_grad(self, index: int, param: torch.Tensor, boundary: bool) -> None:
        self.take(index, param)  # at every backward, boundary or not: the buffer is where gradients accumulate

    def take(self, index: int, param: torch.Tensor) -> bool:
        """Make ``param.grad`` its view of the buffer, holding what ``.grad`` held; whether it had one.

        A ``.grad`` that is not the view is the truth (see the module docstring): copying it, as DDP's
        reducer copies into its buckets, spares zeroing the whole buffer every step.
        """
        view = self._views[index]
        grad = param.grad
        if grad is not None and grad.data_ptr() == view.data_ptr():
            return True
        if grad is None:
            view.zero_()
        else:
            view.copy_(grad)
        param.grad = view  # not a use of the values: no wait for a gather in flight (see .pending)
        return grad is not None

    def comm_input(self, bucket: Bucket) -> torch.Tensor:
        region = self.layout.bucket_slice(self.flat, bucket)
        return region if region.dtype == torch.float32 else region.float()

    def nbytes(self) -> int:
        return tensor_bytes(self.flat) + self.reduced.nbytes()


class StagedGrads(GradStorage):
    """Per-bucket fp32 staging at the boundary; ``param.grad`` full-size only between boundaries (stage 2)."""

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device, allocate: Allocate) -> None:
        super().__init__(layout, dtype, device, allocate)
        self._staging: dict[int, torch.Tensor] = {}

    def on_grad(self, index: int, param: torch.Tensor, boundary: bool) -> None:
        if boundary:  # between boundaries the gradient accumulates in `param.grad`, where autograd put it
            self.take(index, param)

    def take(self, index: int, param: torch.Tensor) -> bool:
        bucket, offset = self.layout.bucket_of[index]
        target = self.comm_input(bucket).narrow(0, offset, param.numel())
        if param.grad is None:
            target.zero_()  # no gradient since it was cleared: zeros for the sum, and not used here
            return False
        target.copy_(param.grad.reshape(-1))
        param.grad = None  # the full-size gradient is no longer needed
        return True

    def comm_input(self, bucket: Bucket) -> torch.Tensor:
        staging = self._staging.get(bucket.index)
        if staging is None:
            # `take` writes every parameter's slice (its gradient, or zeros) before the bucket is reduced,
            # so only the padding is zeroed here: no memset of the whole bucket every step
            staging = torch.empty(bucket.padded, dtype=torch.float32, device=self.device)
            staging[bucket.numel :].zero_()
            self._staging[bucket.index] = staging
        return staging

    def reduced_all(self) -> None:
        self._staging.clear()

    def nbytes(self) -> int:
        grads = [p.grad for p in self.layout.params if p.grad is not None]
        return self.reduced.nbytes() + tensor_bytes(grads)
