"""Optimizer offload to NVMe against none, at stage 2 on 2 ranks: memory, step time, bytes moved.

``python -m benchmarks.offload [--params 10] [--steps 5] [--nvme DIR]`` launches one 2-rank job per
setting (so each peak is its own) and prints, per rank: peak resident memory (``VmHWM``) and its growth
over the process before ``initialize``, the median step time, and the bytes the offload read and
wrote per step against theory (12 bytes per element of this rank's shard each way for AdamW: fp32
master and two moments).  Also the disk's own write and read bandwidth on ``--nvme`` for scale.
The figures in docs/offload.md come from here.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import tempfile
import time
from typing import Any, Optional, cast

import torch
import torch.distributed as dist
from torch import nn

import shardwise
from shardwise.testing import run_distributed
from shardwise.zero.flat import FlatStrategy

from .worker import rss_bytes

__all__ = ["disk_bandwidth", "main", "measure"]

WIDTH = 1000


def _model(millions: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(millions)])


def measure(millions: int, steps: int, nvme: Optional[str], sub_group: int, buffers: int) -> dict[str, Any]:
    """One rank's figures for a run with offload to ``nvme`` (None: no offload)."""
    before = rss_bytes()
    model = _model(millions)
    zero: dict[str, Any] = {"stage": 2}
    if nvme is not None:
        zero.update(offload_optimizer={"device": "nvme", "nvme_path": nvme, "buffer_count": buffers},
                    sub_group_size=sub_group)
    engine = shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), {"zero_optimization": zero})
    data = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))
    times, moved = [], (0, 0)
    for step in range(steps + 2):  # two warm-up steps: the first creates Adam's state
        if step == 2:
            moved = _moved(engine)
        start = time.perf_counter()
        engine.backward(engine(data).square().mean())
        engine.step()
        if step >= 2:
            times.append(time.perf_counter() - start)
    read, written = (now - then for now, then in zip(_moved(engine), moved))
    shard = cast(FlatStrategy, engine.strategy).layout.shard_numel
    held = rss_bytes()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the process holds, less what glibc keeps of freed memory
    trimmed = rss_bytes()
    engine.destroy()
    return {"peak_rss": rss_bytes("VmHWM"), "growth": rss_bytes("VmHWM") - before, "held": held - before,
            "trimmed": trimmed - before,
            "step_ms": statistics.median(times) * 1e3, "read_per_step": read / steps,
            "written_per_step": written / steps, "theory": 12 * shard, "shard": shard}


def _moved(engine: Any) -> tuple[int, int]:
    files = getattr(engine.strategy.masters, "files", None)
    return (files.bytes_read, files.bytes_written) if files is not None else (0, 0)


def disk_bandwidth(folder: str, mib: int = 256) -> tuple[float, float]:
    """(write, read) MiB/s of one file of ``mib`` MiB on ``folder``: fsync'd, then read after dropping it
    from the page cache (``posix_fadvise``)."""
    block = os.urandom(1 << 20)
    path = os.path.join(folder, "bandwidth.bin")
    start = time.perf_counter()
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC)
    for _ in range(mib):
        os.write(fd, block)
    os.fsync(fd)
    os.close(fd)
    write = mib / (time.perf_counter() - start)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    start = time.perf_counter()
    while os.read(fd, 1 << 20):
        pass
    os.close(fd)
    os.unlink(path)
    return write, mib / (time.perf_counter() - start)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=10, help="millions of parameters (1000x1000 layers)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--sub-group", type=int, default=262_144)
    parser.add_argument("--buffers", type=int, default=4)
    parser.add_argument("--nvme", default=None, help="folder on the disk to offload to (default: a temp folder)")
    args = parser.parse_args(argv)
    nvme = args.nvme or tempfile.mkdtemp(prefix="offload-bench-")
    write, read = disk_bandwidth(nvme)
    print(f"disk under {nvme}: write {write:.0f} MiB/s (fsync'd), read {read:.0f} MiB/s (page cache dropped)")
    for where in (None, nvme):
        ranks = run_distributed(measure, 2, args=(args.params, args.steps, where, args.sub_group, args.buffers),
                                timeout=600)
        label = "nvme offload" if where else "no offload  "
        for rank, r in enumerate(ranks):
            print(f"{label} rank {rank}: peak RSS {r['peak_rss'] / 2**20:.0f} MiB (+{r['growth'] / 2**20:.0f} MiB "
                  f"over before initialize; after the steps +{r['held'] / 2**20:.0f}, "
                  f"+{r['trimmed'] / 2**20:.0f} after malloc_trim), step {r['step_ms']:.0f} ms, read {r['read_per_step'] / 1e6:.1f} MB "
                  f"written {r['written_per_step'] / 1e6:.1f} MB per step (theory {r['theory'] / 1e6:.1f} MB "
                  f"each: 12 B x {r['shard']:,} elements)")


if __name__ == "__main__":
    main()
