"""A sum of squares over no gradient lives where the gradients live.

A stage 1-2 rank whose flat layout holds no trainable parameter (everything
frozen for a while) still all-reduces its gradient norm with the others, and
NCCL reduces CUDA tensors only: a zero made on the CPU there fails the step on
GPUs and nowhere else.  The meta device shows the placement on a machine
without a GPU.
"""

from __future__ import annotations

import torch

from shardwise.zero.flat.grads import ReducedGrads
from shardwise.zero.flat.layout import FlatLayout


def test_no_gradient_sums_to_a_zero_on_the_gradients_device() -> None:
    layout = FlatLayout([], bucket_numel=1024, num_shards=2, rank=1)  # nothing trainable
    meta = torch.device("meta")
    for reduced in (ReducedGrads.in_buffer(layout, torch.empty(0, device=meta)), ReducedGrads.separate(layout, meta)):
        assert reduced.sq().device == meta and reduced.norm_share().device == meta
        assert reduced.zero().device == meta and reduced.zero().dtype == torch.float32
