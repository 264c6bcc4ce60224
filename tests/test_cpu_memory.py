"""`benchmarks.cpu_memory.LiveBytes`: live tensor bytes on the CPU, counted as the CUDA allocator would count them."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.cpu_memory import LiveBytes  # noqa: E402

MB = 2**20


def test_live_bytes_follow_allocations_frees_and_resizes() -> None:
    gc.collect()  # (as below)
    kept = torch.zeros(MB // 4)  # 1 MiB, alive before: counted in `before`
    freed = torch.zeros(MB // 4)  # resized to 0 inside: counts 0 from then on
    with LiveBytes() as tracker:
        start = tracker.before
        temporary = torch.ones(2 * MB // 4)  # 2 MiB, dropped below: in the peak, not after
        del temporary
        freed.untyped_storage().resize_(0)
        torch.zeros(1)  # an operation: the tracker samples after each one
        assert tracker.live() == start - MB
    assert tracker.peak - start == 2 * MB  # the temporary, while it lived
    assert kept.numel() == MB // 4


def test_live_bytes_count_what_autograd_saves() -> None:
    gc.collect()  # earlier tests' garbage in cycles: collected inside, it would move `live()` under the test
    x = torch.randn(MB // 4, requires_grad=True)
    with LiveBytes() as tracker:
        start = tracker.live()
        y = x.exp()  # exp saves its 1 MiB output for backward
        loss = y.sum()
        del y  # the Python tensor goes; the storage autograd saved stays
        assert tracker.live() - start == MB + 4  # (and the loss)
        loss.backward()
        del loss
        assert tracker.live() - start == MB  # backward freed it; x.grad (1 MiB) is alive beside x
