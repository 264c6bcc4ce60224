"""The largest GPT that trains 3 steps at stage 3 on 2 ranks under a per-rank memory cap, with and without NVMe offload.

``python -m benchmarks.offload_capacity [--cap-mib 1024] [--layers 2,4,8,...] [--nvme DIR]`` builds the GPT
of ``examples/gpt.py`` (``n_embd`` 1024, 16 heads, byte vocabulary, 64 positions; about 12.6M parameters
per layer) under ``shardwise.zero.Init`` (so no rank ever holds the whole model), trains it 3 steps with
AdamW in fp32, and records each rank's peak resident memory over the process before the model was built
(``VmHWM``).  Sizes go up until one passes the cap; the largest under it is printed for no offload and for
``offload_optimizer`` + ``offload_param`` on NVMe (``max_in_cpu`` 0).

A proxy for the whole machine, where no run may use most of it: glibc is told to hand large blocks back
at once (``mallopt(M_MMAP_THRESHOLD)``), so the peak is what the process needs rather than what its heap
kept; the page cache (which serves the offload's files here) is not the process's and is not counted.
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile
import time
from typing import Any, Optional

import torch

import shardwise
from shardwise.testing import run_distributed

from .offload import _zero
from .worker import rss_bytes
from .workload import gpt_module

__all__ = ["main", "train_capped"]

_M_MMAP_THRESHOLD = -3


def train_capped(layers: int, what: str, nvme: str, steps: int = 3) -> dict[str, Any]:
    """One rank: build the GPT partitioned, train ``steps`` steps, return its peak memory and times."""
    ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 1 << 20)
    before = rss_bytes()
    gpt = gpt_module()
    zero = _zero(3, what, nvme, 1_000_000, 4, 0)
    # as a memory-bound DeepSpeed config would (both settings alike): free each unit after use, gather at
    # most 20M elements at once, so the peak is what the stage must hold rather than what it caches
    zero.update(stage3_max_reuse_distance=0, stage3_max_live_parameters=20_000_000)
    config = {"zero_optimization": zero, "train_micro_batch_size_per_gpu": 1}
    start = time.perf_counter()
    torch.manual_seed(0)
    with shardwise.zero.Init(config=config):
        model = gpt.GPT(gpt.GPTConfig(vocab_size=256, block_size=64, n_layer=layers, n_head=16, n_embd=1024))
    numel = sum(p.numel() for p in model.parameters())
    engine = shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)
    built = time.perf_counter() - start
    idx = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        _, loss = engine(idx, idx)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
    peak = rss_bytes("VmHWM") - before
    # the model is dropped next: gathering it whole onto each rank, as a plain `destroy()` does, would need
    # 4 bytes a parameter a rank (10 GB at 2.5B parameters), more than the training above
    engine.destroy(restore_params=False)
    return {"numel": numel, "peak": peak, "build_s": built, "step_s": times, "loss": float(loss)}


def _largest(layers: list[int], what: str, nvme: str, cap: int) -> Optional[dict[str, Any]]:
    """Run sizes in order until one passes ``cap``; the last under it."""
    best = None
    for count in layers:
        ranks = run_distributed(train_capped, 2, args=(count, what, nvme), timeout=1800)
        peak = max(r["peak"] for r in ranks)
        r = ranks[0]
        print(f"{what:5} {count:3} layers {r['numel'] / 1e6:7.1f}M params: peak +{peak / 2**20:.0f} MiB a rank, "
              f"built in {r['build_s']:.0f} s, steps {', '.join(f'{t:.1f}' for t in r['step_s'])} s, "
              f"loss {r['loss']:.3f}", flush=True)
        if peak > cap:
            break
        best = {**r, "layers": count, "peak": peak}
    return best


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap-mib", type=int, default=1024, help="per-rank peak over the process before building")
    parser.add_argument("--layers", default="2,4,6,8,12,16,24,32", help="layer counts to try, in order")
    parser.add_argument("--settings", default="none,both")
    parser.add_argument("--nvme", default=None, help="folder on the disk to offload to (default: a temp folder)")
    args = parser.parse_args(argv)
    nvme = args.nvme or tempfile.mkdtemp(prefix="offload-capacity-")
    layers = [int(n) for n in args.layers.split(",")]
    found = {what: _largest(layers, what, nvme, args.cap_mib * 2**20) for what in args.settings.split(",")}
    for what, best in found.items():
        size = "none fits" if best is None else f"{best['layers']} layers, {best['numel'] / 1e6:.1f}M parameters"
        print(f"largest under {args.cap_mib} MiB a rank, offload {what}: {size}")


if __name__ == "__main__":
    main()
