"""Where the flat stages keep fp32 master weights and averaged gradients: chosen once per layout.

Three arrangements of the master weights, one class each:

* :class:`ParamsAreMasters` (fp32, nothing sharded: stage 0): the model's own
  parameters are the master weights, stepped in place as in plain DDP; their
  ``.grad`` views into the flat gradient buffer are the master gradients.
* :class:`InPlaceMasters` (fp32, sharded): the parameters are views into one
  flat buffer of the model; this rank's slice of each bucket *is* its master,
  so the all-gather after the step runs in place and no copy exists.
* :class:`SeparateMasters` (fp16/bf16): the parameters live in a flat buffer of
  the compute dtype; the masters are a separate fp32 shard, cast when published.

Chosen beside the gradient storage (:mod:`.grads`), whose averaged gradients
the masters' ``.grad`` view.  The strategy asks its arrangement for what to step and what to gather and
never branches on the mode itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Mapping, MutableMapping

import torch

from ..distributed import Comm
from ..param_state import KeptSlot, OptimizerSlot
from .carry import export_state, import_state
from .frozen import Kept
from .grads import GradStorage, ReducedGrads
from .layout import Bucket, FlatLayout

__all__ = ["InPlaceMasters", "Masters", "ParamsAreMasters", "SeparateMasters", "choose_masters"]

Gather = Callable[[torch.Tensor], torch.Tensor]


class Masters(ABC):
    """This rank's fp32 master weights for a :class:`FlatLayout`."""

    #: whether kept copies of the masters own their memory (False: they are views of the model)
    owns_copies = True

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device) -> None:
        self.layout = layout
        self.dtype = dtype
        self.device = device
        #: the model's flat parameter buffer (empty when the parameters are not flattened)
        self.param_flat = torch.empty(0)
        #: per bucket, this rank's fp32 master slice
        self.slices: list[torch.Tensor] = []

    @abstractmethod
    def build(self, initial: Mapping[int, torch.Tensor]) -> None:
        """Lay the trainable parameters out and fill the masters (``initial``: exact fp32 values by id)."""

    def _flatten(self, dtype: torch.dtype) -> None:
        """Move every trainable parameter into one flat buffer of ``dtype`` (they become views of it)."""
        layout = self.layout
        self.param_flat = torch.zeros(layout.padded_numel, dtype=dtype, device=self.device)
        for index, param in enumerate(layout.params):
            view = layout.param_slice(self.param_flat, index)
            view.copy_(param.detach().reshape(-1))
            param.data = view.view_as(param)

    def steps(self, grads: ReducedGrads) -> dict[int, torch.Tensor]:
        """Per parameter id, the fp32 tensor the inner optimizer steps, its ``.grad`` wired to ``grads``."""
        layout = self.layout
        views: dict[int, torch.Tensor] = {}
        for piece in layout.pieces:
            bucket, _ = layout.bucket_of[piece.param]
            at = piece.shard_offset - bucket.shard_offset
            view = self.slices[bucket.index].narrow(0, at, piece.numel)
            view.grad = grads.slices[bucket.index].narrow(0, at, piece.numel)
            views.setdefault(id(layout.params[piece.param]), view)
        return views

    def gather_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per bucket: (the model's region of it, this rank's master slice in the compute dtype).

        An all-gather of each pair re-assembles the updated parameters; with one
        shard, copying the second into the first does.
        """
        layout = self.layout
        return [(layout.bucket_slice(self.param_flat, b), self._published(b)) for b in layout.buckets]

    def _published(self, bucket: Bucket) -> torch.Tensor:
        return self.slices[bucket.index]

    def copy_into_params(self) -> None:
        """One shard: write the masters into the model's parameters (cast to the compute dtype)."""
        layout = self.layout
        for bucket in layout.buckets:
            region, master = layout.bucket_slice(self.param_flat, bucket), self.slices[bucket.index]
            if region.data_ptr() != master.data_ptr():
                region.copy_(master)

    @abstractmethod
    def shard(self) -> torch.Tensor:
        """This rank's masters as one contiguous tensor (a copy where they are not contiguous)."""

    def full(self, gather: Gather) -> dict[int, torch.Tensor]:
        """Full fp32 value of every trainable parameter by id (collective through ``gather``)."""
        layout = self.layout
        flat = gather(self.shard())
        return {id(p): layout.param_slice(flat, i).view_as(p).clone() for i, p in enumerate(layout.params)}

    def nbytes(self) -> int:
        """Bytes of master weights held apart from the model's parameters."""
        return 0

    def export(self, state: MutableMapping[Any, Any], steps: dict[int, torch.Tensor], comm: Comm,
               gather: Gather) -> dict[int, Kept]:
        """Every parameter's full master and optimizer state, taken out of ``state`` (collective)."""
        carried = export_state(self.layout, self.shard(), steps, state, comm, gather)
        state.clear()
        return carried

    def adopt(self, carried: Mapping[int, Kept], state: MutableMapping[Any, Any], steps: dict[int, torch.Tensor]) -> None:
        """Fill this rank's new masters and optimizer state from ``carried`` (after a rebuild)."""
        import_state(self.layout, steps, state, carried)

    def release(self) -> None:
        """Give every parameter its own storage again (before the layout is rebuilt)."""
        for param in self.layout.params:
            param.data = param.data.clone()


class ParamsAreMasters(Masters):
    """fp32, one shard, full-size gradients: the parameters themselves are stepped (plain DDP)."""

    owns_copies = False

    def build(self, initial: Mapping[int, torch.Tensor]) -> None:
        pass  # nothing to lay out: the model's parameters keep their own storage

    def steps(self, grads: ReducedGrads) -> dict[int, torch.Tensor]:
        return {id(p): p for p in self.layout.params}  # each .grad is its view of the gradient buffer

    def gather_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return []  # the optimizer updated the parameters themselves

    def copy_into_params(self) -> None:
        pass

    def shard(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.layout.params]) if self.layout.params else torch.zeros(0)

    def full(self, gather: Gather) -> dict[int, torch.Tensor]:
        return {id(p): p.detach().float().clone() for p in self.layout.params}

    def export(self, state: MutableMapping[Any, Any], steps: dict[int, torch.Tensor], comm: Comm,
               gather: Gather) -> dict[int, Kept]:
        # Every rank holds every parameter whole: nothing to gather, the master is the parameter.
        carried = {}
        for param in self.layout.params:
            kept = OptimizerSlot(state, param).get()
            state.pop(param, None)
            carried[id(param)] = Kept(0, param.numel(), param.detach().view(-1), KeptSlot(kept))
        return carried

    def adopt(self, carried: Mapping[int, Kept], state: MutableMapping[Any, Any], steps: dict[int, torch.Tensor]) -> None:
        for param in self.layout.params:
            kept = carried.get(id(param))
            if kept is None:
                continue
            flat = param.detach().view(-1)
            if flat.data_ptr() != kept.master.data_ptr():
                flat.copy_(kept.master)
            if kept.state:
                OptimizerSlot(state, param).set(kept.state)

    def release(self) -> None:
        pass  # never flattened


class InPlaceMasters(Masters):
    """fp32 and sharded: this rank's slice of the model's own flat buffer is its master."""

    def build(self, initial: Mapping[int, torch.Tensor]) -> None:
        self._flatten(torch.float32)
        self.slices = [self.layout.owned_slice(self.param_flat, b) for b in self.layout.buckets]

    def shard(self) -> torch.Tensor:
        return torch.cat(self.slices) if self.slices else torch.zeros(0)

    def full(self, gather: Gather) -> dict[int, torch.Tensor]:
        # the parameters hold the full, current values already: no gather needed
        layout = self.layout
        return {id(p): layout.param_slice(self.param_flat, i).view_as(p).clone() for i, p in enumerate(layout.params)}


class SeparateMasters(Masters):
    """fp16/bf16: parameters in a flat buffer of the compute dtype, fp32 masters in a shard of their own."""

    def build(self, initial: Mapping[int, torch.Tensor]) -> None:
        layout = self.layout
        self._flatten(self.dtype)
        self.master = torch.zeros(layout.shard_numel, dtype=torch.float32, device=self.device)
        self.slices = [layout.shard_slice(self.master, b) for b in layout.buckets]
        for piece in layout.pieces:
            param = layout.params[piece.param]
            source = initial.get(id(param), param.data).reshape(-1)
            self.master.narrow(0, piece.shard_offset, piece.numel).copy_(source[piece.start : piece.end])

    def _published(self, bucket: Bucket) -> torch.Tensor:
        return self.slices[bucket.index].to(self.dtype)

    def shard(self) -> torch.Tensor:
        return self.master

    def nbytes(self) -> int:
        return self.master.numel() * self.master.element_size()


def choose_masters(layout: FlatLayout, dtype: torch.dtype, device: torch.device, grads: GradStorage) -> Masters:
    """The arrangement for ``layout`` beside the gradient storage ``grads`` (:mod:`.grads`): the parameters
    are their own masters only where ``param.grad`` holds the full-size gradient averaged in place."""
    if dtype != torch.float32:
        return SeparateMasters(layout, dtype, device)
    if layout.num_shards == 1 and grads.in_params:
        return ParamsAreMasters(layout, dtype, device)
    return InPlaceMasters(layout, dtype, device)
