"""Where the flat stages keep fp32 master weights and averaged gradients: chosen once per layout.

Four arrangements of the master weights, one class each:

* :class:`ParamsAreMasters` (fp32, nothing sharded: stage 0): the model's own
  parameters are the master weights, stepped in place as in plain DDP; their
  ``.grad`` views into the flat gradient buffer are the master gradients.
* :class:`InPlaceMasters` (fp32, sharded): the parameters are views into one
  flat buffer of the model; this rank's slice of each bucket *is* its master,
  so the all-gather after the step runs in place and no copy exists.
* :class:`SeparateMasters` (fp16/bf16): the parameters live in a flat buffer of
  the compute dtype; the masters are a separate fp32 shard, cast into this
  rank's slice of it when published (the all-gather then runs in place too).

Chosen beside the gradient storage (:mod:`.grads`), whose averaged gradients
the masters' ``.grad`` view.  The strategy asks its arrangement for what to step and what to gather and
never branches on the mode itself.
"""

from __future__ import annotations

from typing import Any, Mapping, MutableMapping, Optional

import torch

from ..distributed import Comm
from ..param_state import KeptSlot, OptimizerSlot
from .grads import GradStorage, ReducedGrads
from .layout import FlatLayout
from .masters_base import Gather, Masters
from .offloaded import OffloadedMasters
from .store.frozen import Kept
from .store.plan import OffloadSpec

__all__ = ["InPlaceMasters", "Masters", "OffloadedMasters", "ParamsAreMasters", "SeparateMasters", "choose_masters"]


class ParamsAreMasters(Masters):
    """fp32, one shard, full-size gradients: the parameters themselves are stepped (plain DDP)."""

    owns_copies = False

    def build(self, initial: Mapping[int, torch.Tensor]) -> None:
        pass  # nothing to lay out: the model's parameters keep their own storage

    def steps(self, grads: ReducedGrads) -> dict[int, torch.Tensor]:
        return {id(p): p for p in self.layout.params}  # each .grad is its view of the gradient buffer

    def gather_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return []  # the optimizer updated the parameters themselves

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
        self.slices = self.owned  # the masters are this rank's slices of the model's buffer: nothing to publish

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

    def shard(self) -> torch.Tensor:
        return self.master

    def nbytes(self) -> int:
        return self.master.numel() * self.master.element_size()


def choose_masters(layout: FlatLayout, dtype: torch.dtype, device: torch.device, grads: GradStorage,
                   offload: Optional[OffloadSpec] = None) -> Masters:
    """The arrangement for ``layout`` beside the gradient storage ``grads`` (:mod:`.grads`): offloaded where
    ``offload`` asks for NVMe; else the parameters are their own masters only where ``param.grad`` holds the
    full-size gradient averaged in place."""
    if offload is not None:
        return OffloadedMasters(layout, dtype, device, offload)
    if dtype != torch.float32:
        return SeparateMasters(layout, dtype, device)
    if layout.num_shards == 1 and grads.in_params:
        return ParamsAreMasters(layout, dtype, device)
    return InPlaceMasters(layout, dtype, device)
