"""Where the flat stages keep gradients, from autograd's hooks to the reduced gradient (docs/life-of-a-gradient.md).

Two storages, chosen once per stage:

* :class:`FlatGrads` (stages 0 and 1): one full-size flat buffer that ``param.grad`` views into, as DDP's
  ``gradient_as_bucket_view``; a bucket is reduced straight from its region.  The buffer comes from the
  allocator the strategy passes in: private memory, or memory every rank maps when the collectives go through
  shared memory (the reduction then reads in place).
* :class:`StagedGrads` (stage 2): no full-size buffer.  Between boundaries gradients accumulate in
  ``param.grad``; at a boundary each is copied (in fp32) into its bucket's staging tensor and released, and the
  staging goes once the bucket is reduced.

A complete bucket goes to the stage's collective (one of the functions below) only once every earlier one has gone,
so all ranks issue the same collectives in the same order (:meth:`GradStorage.on_grad`).  ``param.grad`` is the
truth, as in plain PyTorch: whatever cleared it (``zero_grad``, ``p.grad = None``) discarded what the storage held, and
autograd's fresh tensor is copied over the storage, never added.
"""

from __future__ import annotations

import functools
import weakref
from abc import ABC, abstractmethod
from typing import Callable, NamedTuple, Optional

import torch

from ...comm.distributed import Comm, Work, wait_all
from ..base import Backward, tensor_bytes
from .layout import Bucket, FlatLayout

__all__ = [
    "Allocate", "FlatGrads", "GradStorage", "Reduce", "ReducedGrads", "StagedGrads", "all_reduce_in_place",
    "all_reduce_keeping_slice", "private_zeros", "reduce_scatter_slice",
]

#: ``allocate(numel, dtype, device)``: a zeroed flat tensor (collective when the memory is shared)
Allocate = Callable[[int, torch.dtype, torch.device], torch.Tensor]

#: the stage's collective, ``reduce(source, output)``: start averaging ``source`` (a bucket's local gradients,
#: full size, any float dtype) into ``output`` (this rank's slice); returns the work and, when the result is
#: left full-size instead (an all-reduce standing in for a reduce-scatter), the tensor holding it
Reduce = Callable[[torch.Tensor, torch.Tensor], tuple[Work, Optional[torch.Tensor]]]


# The stages' collectives (a strategy binds one to its `Comm` with functools.partial and hands it to the storage):
# written here, beside the storage that calls them, so a bucket goes from the storage straight to the transport.

def all_reduce_in_place(comm: Comm, source: torch.Tensor, output: torch.Tensor) -> tuple[Work, None]:
    """Stage 0 (one shard, ``output`` is the whole bucket): average in ``output``; a bf16/fp16 ``source`` is
    cast once, straight into the fp32 slice the optimizer reads."""
    if source.data_ptr() != output.data_ptr():
        output.copy_(source)
    return comm.all_reduce(output, async_op=True), None


def reduce_scatter_slice(comm: Comm, source: torch.Tensor, output: torch.Tensor) -> tuple[Work, None]:
    """Stages 1-2: each rank receives the average of exactly the slice it owns."""
    if source.dtype != output.dtype:
        source = source.to(output.dtype)  # bf16/fp16 gradients averaged in fp32
    return comm.reduce_scatter(output, source, async_op=True), None


def all_reduce_keeping_slice(comm: Comm, source: torch.Tensor, output: torch.Tensor) -> tuple[Work, torch.Tensor]:
    """Stages 1-2 where an all-reduce is the cheaper collective (gloo over sockets): twice the bytes of a
    reduce-scatter, the whole average returned for the storage to keep this rank's slice."""
    if source.dtype != output.dtype:
        source = source.to(output.dtype)
    return comm.all_reduce(source, async_op=True), source


def private_zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The allocator of this process's own memory."""
    return torch.zeros(numel, dtype=dtype, device=device)


class ReducedGrads:
    """Per bucket, where this rank's averaged fp32 gradient lands (what the optimizer reads)."""

    def __init__(self, slices: list[torch.Tensor], contiguous: Optional[torch.Tensor], owned: bool,
                 device: torch.device) -> None:
        self.slices = slices
        #: where the gradients live: a sum over no gradient at all is a zero there too (NCCL reduces CUDA tensors only)
        self.device = device
        #: all of them as one tensor when they are contiguous (one kernel for the norm)
        self.contiguous, self._owned = contiguous, owned
        #: (sum of squares taken while the reduction was waited for, the slices' versions then)
        self._share: Optional[tuple[torch.Tensor, tuple[int, ...]]] = None
        #: per bucket, whether its slice has memory (:meth:`release` / :meth:`ensure`; all, unless per bucket)
        self._live = [True] * len(slices)
        self._per_bucket = owned and contiguous is None

    @classmethod
    def in_buffer(cls, layout: FlatLayout, grad_flat: torch.Tensor) -> "ReducedGrads":
        """This rank's slices of the full fp32 gradient buffer (reduced in place)."""
        slices = [layout.owned_slice(grad_flat, b) for b in layout.buckets]
        return cls(slices, grad_flat if layout.num_shards == 1 else None, owned=False, device=grad_flat.device)

    @classmethod
    def separate(cls, layout: FlatLayout, device: torch.device, per_bucket: bool = False) -> "ReducedGrads":
        """A separate fp32 shard; ``per_bucket``: a tensor per bucket, each with memory only from its bucket's first
        gradient in a reducing backward to the step (:meth:`ensure`, :meth:`release`)."""
        if per_bucket:
            slices = [torch.zeros(b.shard_numel, dtype=torch.float32, device=device) for b in layout.buckets]
            return cls(slices, None, owned=True, device=device)
        shard = torch.zeros(layout.shard_numel, dtype=torch.float32, device=device)
        return cls([layout.shard_slice(shard, b) for b in layout.buckets], shard, owned=True, device=device)

    def ensure(self, index: Optional[int] = None, written: int = 0) -> None:
        """Bucket ``index``'s slice (every slice: None) has its memory back after :meth:`release`, zeroed but for its
        first ``written`` elements (the caller is about to write them: a bucket's gradients, staged)."""
        for i in range(len(self.slices)) if index is None else (index,):
            if not self._live[i]:
                grad = self.slices[i]
                grad.untyped_storage().resize_(grad.numel() * grad.element_size())
                grad[written:].zero_()
                self._live[i] = True

    def release(self) -> None:
        """The gradients were stepped or dropped: per bucket, their memory goes until the bucket's next gradient
        (as FSDP2 makes its gradients in backward: 4 bytes a parameter less from the step to the middle of the next
        backward)."""
        if self._per_bucket:
            for i, grad in enumerate(self.slices):
                grad.untyped_storage().resize_(0)
                self._live[i] = False
            self._share = None

    def bucket_sq(self, index: int) -> torch.Tensor:
        """Sum of squares of bucket ``index``'s slice (this rank's part)."""
        self.ensure(index)
        grad = self.slices[index].float()
        return torch.dot(grad, grad) if grad.numel() else grad.new_zeros(())

    def versions(self) -> tuple[int, ...]:
        """The slices' in-place write counters: a change means the gradients were written to."""
        return tuple(s._version for s in self.slices)

    def sq(self) -> torch.Tensor:
        """Sum of squares (this rank's part), computed now."""
        self.ensure()
        if self.contiguous is not None:
            grad = self.contiguous.float()
            return torch.dot(grad, grad) if grad.numel() else grad.new_zeros(())
        if not self.slices:
            return self.zero()
        return torch.stack([self.bucket_sq(index) for index in range(len(self.slices))]).sum()

    def zero(self) -> torch.Tensor:
        """The sum of squares of no gradient, on the gradients' device."""
        return torch.zeros((), dtype=torch.float32, device=self.device)

    def note_share(self, sq: torch.Tensor) -> None:
        """The sum of squares was taken as the reduction finished: :meth:`norm_share` returns it while the
        gradients stay untouched."""
        self._share = (sq, self.versions())

    def forget_share(self) -> None:
        self._share = None

    def norm_share(self) -> torch.Tensor:
        """This rank's sum of squares: the one noted while the reduction was waited for, unless something
        wrote to the gradients since (a user's own scaling between backward and step: then computed afresh)."""
        share = self._share
        if share is not None and share[1] == self.versions():
            return share[0]
        return self.sq()

    def scale(self, factor: float) -> None:
        self.ensure()
        if self.contiguous is not None:
            self.contiguous.mul_(factor)
        elif self.slices:
            torch._foreach_mul_(self.slices, factor)

    def nbytes(self) -> int:
        """Bytes held apart from the full gradient buffer."""
        if not self._owned:
            return 0
        if self.contiguous is not None:
            return self.contiguous.numel() * self.contiguous.element_size()
        return sum(grad.untyped_storage().nbytes() for grad in self.slices)  # (0 for a released bucket)


class _InFlight(NamedTuple):
    """One bucket's reduction: what to wait for and where its result goes."""

    work: Work
    bucket: Bucket
    #: the full-size result to keep this rank's slice of (None: the collective wrote ``landed`` itself)
    full: Optional[torch.Tensor]
    #: this rank's slice as the collective leaves it (in the wire dtype)
    landed: torch.Tensor
    #: the fp32 slice the optimizer reads, when ``landed`` is a low-precision copy of it (else None)
    output: Optional[torch.Tensor]


class GradStorage(ABC):
    """This rank's gradients for a :class:`FlatLayout`, from autograd's hooks to the reduction.

    ``backward`` is the strategy's (what the current backward does); ``reduce`` the stage's collective;
    ``wire`` the dtype gradients travel in (``communication_data_type``), averaged back into fp32.
    """

    #: whether ``param.grad`` holds the full-size gradient, averaged in place (the masters may be the params)
    in_params = False

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device, allocate: Allocate,
                 backward: Backward, reduce: Reduce, wire: torch.dtype = torch.float32, per_bucket: bool = False) -> None:
        self.layout, self.device, self.backward, self._reduce, self._wire = layout, device, backward, reduce, wire
        #: a separate reduced tensor per bucket, with memory from its first gradient to the step (ReducedGrads.release)
        self.per_bucket = per_bucket
        self.reduced = self._reduced_grads(dtype)
        #: told each bucket once its reduction landed (the master store's home then copies it to host memory)
        self.landed: Callable[[Bucket], None] = lambda bucket: None
        self._reset()

    def _reduced_grads(self, dtype: torch.dtype) -> ReducedGrads:
        return ReducedGrads.separate(self.layout, self.device, self.per_bucket)

    def _reset(self) -> None:
        """A new backward of the engine: nothing seen, nothing launched."""
        self._serial = self.backward.serial
        self._pending = [len(b.params) for b in self.layout.buckets]
        self._seen = [False] * len(self.layout.params)
        #: per parameter: whether this rank had a gradient for it (see :meth:`finish`)
        self._used = [True] * len(self.layout.params)
        self._next = 0
        self._works: list[_InFlight] = []
        self.reduced.forget_share()

    def hook(self, index: int) -> Callable[[torch.Tensor], None]:
        """Parameter ``index``'s post-accumulate hook: :meth:`on_grad`, with this storage held weakly (a dropped
        engine is freed, :func:`..base.remove_with`), the gradient landing in this file first."""
        return functools.partial(_on_grad, weakref.ref(self), index)

    def on_grad(self, index: int, param: torch.Tensor) -> None:
        """Autograd's post-accumulate hook of parameter ``index``: keep the gradient; at a boundary, launch
        each bucket once it is complete and every earlier one is launched."""
        backward = self.backward
        if backward.serial != self._serial:
            self._reset()
        # another engine's backward can reach this model: keep the gradient, reduce nothing
        boundary = backward.active and backward.sync and not self._seen[index]
        self.keep(index, param, boundary)
        if backward.active:
            backward.arrivals += 1
        if not boundary:
            return
        self._seen[index] = True
        bucket, _ = self.layout.bucket_of[index]
        self._pending[bucket.index] -= 1
        buckets = self.layout.buckets
        while self._next < len(buckets) and self._pending[self._next] == 0:
            self._launch(buckets[self._next])
            self._next += 1

    def _launch(self, bucket: Bucket) -> None:
        """Hand ``bucket`` to the stage's collective (in the wire dtype), its result landing in fp32."""
        source = self.comm_input(bucket)
        self.reduced.ensure(bucket.index)
        output = self.reduced.slices[bucket.index]
        if self._wire == output.dtype:
            work, full = self._reduce(source, output)
            self._works.append(_InFlight(work, bucket, full, output, None))
            return
        # `communication_data_type`: half the bytes on the wire, the result averaged back into fp32 (a copy:
        # the storage's own gradients stay as they are)
        low = source.to(self._wire, copy=True)
        landed = torch.empty(output.numel(), dtype=self._wire, device=output.device)
        work, full = self._reduce(low, landed)
        self._works.append(_InFlight(work, bucket, full, landed, output))

    def _complete(self, flight: _InFlight) -> None:
        """A bucket's reduction finished (waited for): this rank's slice of it where the optimizer reads it."""
        bucket = flight.bucket
        if flight.full is not None:  # an all-reduce stood in for a reduce-scatter: keep this rank's slice
            owned = flight.full.narrow(0, self.layout.rank * bucket.shard_numel, bucket.shard_numel)
            if owned.data_ptr() != flight.landed.data_ptr():
                flight.landed.copy_(owned)
        if flight.output is not None:
            flight.output.copy_(flight.landed)
        self.landed(bucket)

    def finish(self) -> list[bool]:
        """After a reducing backward's autograd: take the gradients whose hook did not fire, launch what is
        left, wait for every bucket, and note the norm's share of each.
        Returns, per parameter, whether this rank had a gradient for it."""
        if self.backward.serial != self._serial:
            self._reset()  # no hook of this backward fired
        for bucket in self.layout.buckets[self._next :]:
            self._flush(bucket)
            self._launch(bucket)
        self._next = len(self.layout.buckets)
        wait_all([flight.work for flight in self._works])  # one call for every bucket
        parts = []
        for index, flight in enumerate(self._works):  # one per bucket, in bucket order
            self._complete(flight)
            parts.append(self.reduced.bucket_sq(index))
        self._works = []
        self._reduced_all()
        self.reduced.note_share(torch.stack(parts).sum() if parts else self.reduced.zero())
        return self._used

    def drain(self) -> None:
        """A reducing backward raised partway: wait for the buckets it launched (their results are dropped:
        ``zero_grad`` follows) so that no reduction stays in flight to land in a later step."""
        works, self._works = self._works, []
        for flight in works:
            flight.work.wait()
        self._next = len(self.layout.buckets)  # launch nothing more in this backward
        self.reduced.forget_share()
        self._reduced_all()

    def _flush(self, bucket: Bucket) -> None:
        """Before ``bucket`` is reduced: take the gradients of the parameters whose hook did not fire in this
        backward (accumulated earlier, or none since they were cleared: zeros, and not used here)."""
        for index in bucket.params:
            if not self._seen[index]:
                self._seen[index] = True
                self._used[index] = self.take(index, self.layout.params[index])

    @abstractmethod
    def keep(self, index: int, param: torch.Tensor, boundary: bool) -> None:
        """Autograd finished accumulating ``param``'s gradient; ``boundary``: the first time in a backward
        that reduces, so it goes where the reduction reads it (as :meth:`take` does)."""

    @abstractmethod
    def take(self, index: int, param: torch.Tensor) -> bool:
        """Before its bucket is reduced: put ``param``'s gradient where the reduction reads it (zeros when
        ``.grad`` is None: other ranks may have one to average with); whether it had one."""

    @abstractmethod
    def comm_input(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's summed local gradients as a full-size tensor, the reduction's input."""

    def _reduced_all(self) -> None:
        """Every bucket's reduction has finished."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of gradients this rank holds."""


def _on_grad(storage: "weakref.ref[GradStorage]", index: int, param: torch.Tensor) -> None:
    held = storage()
    if held is not None:  # (once the storage is freed, its hooks do nothing until they are removed)
        held.on_grad(index, param)


class FlatGrads(GradStorage):
    """One full-size flat buffer that ``param.grad`` views into (stages 0 and 1)."""

    in_params = True

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device, allocate: Allocate,
                 backward: Backward, reduce: Reduce, wire: torch.dtype = torch.float32) -> None:
        self.flat = allocate(layout.padded_numel, dtype, device)
        # each parameter's gradient view, built once: every hook compares against it
        self._views = [layout.param_slice(self.flat, i).view_as(p) for i, p in enumerate(layout.params)]
        self._regions = [layout.bucket_slice(self.flat, b) for b in layout.buckets]
        super().__init__(layout, dtype, device, allocate, backward, reduce, wire)

    def _reduced_grads(self, dtype: torch.dtype) -> ReducedGrads:
        # fp32: the averages land in the buffer itself; fp16/bf16: in an fp32 shard of their own
        if dtype == torch.float32:
            return ReducedGrads.in_buffer(self.layout, self.flat)
        return ReducedGrads.separate(self.layout, self.device)

    def keep(self, index: int, param: torch.Tensor, boundary: bool) -> None:
        self.take(index, param)  # at every backward, boundary or not: the buffer is where gradients accumulate

    def take(self, index: int, param: torch.Tensor) -> bool:
        """Make ``param.grad`` its view of the buffer, holding what ``.grad`` held; whether it had one.  A ``.grad``
        that is not the view is the truth (see the module docstring): copying it, as DDP's reducer copies into its
        buckets, spares zeroing the whole buffer every step.
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
        # in the compute dtype: the stage's collective casts it once, where it needs fp32 (stage 0 straight
        # into the fp32 slice it averages in place, instead of a cast copy and then a copy)
        return self._regions[bucket.index]

    def nbytes(self) -> int:
        return tensor_bytes(self.flat) + self.reduced.nbytes()


class StagedGrads(GradStorage):
    """Per-bucket fp32 staging at the boundary; ``param.grad`` full-size only between boundaries (stage 2)."""

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device, allocate: Allocate,
                 backward: Backward, reduce: Reduce, wire: torch.dtype = torch.float32, per_bucket: bool = False) -> None:
        self._staging: dict[int, torch.Tensor] = {}
        super().__init__(layout, dtype, device, allocate, backward, reduce, wire, per_bucket)

    def keep(self, index: int, param: torch.Tensor, boundary: bool) -> None:
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
        if self.layout.num_shards == 1:
            # one shard (stage 0, or one process): the reduction's output is the whole bucket, in fp32, so the
            # gradients are staged straight into it and reduced in place (no second full-size fp32 buffer); `take`
            # writes every parameter's slice (its gradient, or zeros) before the bucket is reduced
            self.reduced.ensure(bucket.index, written=bucket.numel)
            return self.reduced.slices[bucket.index]
        staging = self._staging.get(bucket.index)
        if staging is None:
            # `take` writes every parameter's slice (its gradient, or zeros) before the bucket is reduced,
            # so only the padding is zeroed here: no memset of the whole bucket every step
            staging = torch.empty(bucket.padded, dtype=torch.float32, device=self.device)
            staging[bucket.numel :].zero_()
            self._staging[bucket.index] = staging
        return staging

    def _reduced_all(self) -> None:
        self._staging.clear()

    def nbytes(self) -> int:
        grads = [p.grad for p in self.layout.params if p.grad is not None]
        return self.reduced.nbytes() + tensor_bytes(grads)
