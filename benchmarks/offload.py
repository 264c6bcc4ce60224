"""NVMe offload against none on 2 ranks: memory, step time, bytes moved (stage 2, or stage 3 with parameters too).

``python -m benchmarks.offload --device cuda|cpu ...`` is ZeRO-Offload on one GPU instead (:mod:`.offload_gpu`).

``python -m benchmarks.offload [--params 10] [--steps 5] [--nvme DIR] [--stage 2|3]`` launches one 2-rank
job per setting (so each peak is its own) and prints, per rank: peak resident memory (``VmHWM``) and its
growth over the process before ``initialize``, the median step time, and the bytes the offload read and
wrote per step against theory.  Stage 2 runs no offload and ``offload_optimizer: nvme``; stage 3 also
``offload_param: nvme`` (``max_in_cpu`` 0 unless ``--max-in-cpu``) and both.  Theory per step, per
element of this rank's shard, for AdamW: the optimizer's 12 bytes (fp32 master and two moments) read
and written once; a parameter shard's 4 bytes (2 with ``--bf16``) read twice (the forward's gather and the
backward's) and written once (the step publishing into it, unread); with ``--ratio`` below 1 the optimizer's
bytes count only the elements after the resident split (the first sub-groups stay in host memory).  Also the disk's own write and read bandwidth on
``--nvme`` for scale.  The figures in docs/offload.md come from here.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Optional, cast

import torch
import torch.distributed as dist
from torch import nn

import shardwise
from shardwise.testing import run_distributed

from .worker import _reset_peak_rss, rss_bytes

__all__ = ["disk_bandwidth", "main", "measure"]

WIDTH = 1000


def _model(millions: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(millions)])


#: what each setting offloads
SETTINGS = {2: ("none", "optimizer"), 3: ("none", "optimizer", "param", "both")}


def _zero(stage: int, what: str, nvme: str, sub_group: int, buffers: int, max_in_cpu: int,
          ratio: float = 1.0) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if what in ("optimizer", "both"):
        zero.update(offload_optimizer={"device": "nvme", "nvme_path": nvme, "buffer_count": buffers, "ratio": ratio},
                    sub_group_size=sub_group)
    if what in ("param", "both"):
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme, "max_in_cpu": max_in_cpu}
    return zero


def measure(millions: int, steps: int, nvme: str, sub_group: int, buffers: int, stage: int = 2,
            what: str = "optimizer", max_in_cpu: int = 0, bf16: bool = False, ratio: float = 1.0) -> dict[str, Any]:
    """One rank's figures for a run at ``stage`` offloading ``what`` (none, optimizer, param, both) to ``nvme``
    (of the optimizer state, the share ``ratio``)."""
    before = rss_bytes()
    model = _model(millions)
    zero = _zero(stage, what, nvme, sub_group, buffers, max_in_cpu, ratio)
    engine = shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                                  {"zero_optimization": zero, "bf16": {"enabled": bf16}})
    init_peak = rss_bytes("VmHWM")
    _trim()
    _reset_peak_rss()  # the training peak apart from initialize's (where the whole model exists once)
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
    shard, resident = _shard_numel(engine), _resident_numel(engine)
    width = 2 if bf16 else 4  # a shard's bytes per element
    optimizer = 12 if what in ("optimizer", "both") else 0  # fp32 master and two moments, offloaded elements only
    param = {"param": (2 * width, width), "both": (2 * width, width)}.get(what, (0, 0))
    theory = (optimizer * (shard - resident) + param[0] * shard, optimizer * (shard - resident) + param[1] * shard)
    breakdown = engine.memory_breakdown()
    train_peak, held = rss_bytes("VmHWM"), rss_bytes()
    _trim()
    trimmed = rss_bytes()
    engine.destroy()
    return {"peak_rss": init_peak, "growth": init_peak - before, "train_peak": train_peak - before,
            "held": held - before, "trimmed": trimmed - before,
            "step_ms": statistics.median(times) * 1e3, "read_per_step": read / steps,
            "written_per_step": written / steps, "theory": theory, "shard": shard, "resident": resident,
            "master_bytes": breakdown["master_weights"], "state_bytes": breakdown["optimizer_state"]}


def _trim() -> None:
    """Give back what glibc keeps of freed heap memory (what is left is what the process really holds)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _shard_numel(engine: Any) -> int:
    strategy = engine.strategy
    if strategy.stage == 3:
        return sum(unit.shard_numel for unit in strategy.units)
    return cast(int, strategy.layout.shard_numel)


def _resident_numel(engine: Any) -> int:
    """Elements of this rank's shard whose optimizer state stays in host memory (``ratio`` below 1)."""
    return cast(int, getattr(engine.strategy.store.home, "resident", 0))


def _moved(engine: Any) -> tuple[int, int]:
    """Bytes read and written so far by the optimizer's files and the parameter shards' file."""
    strategy = engine.strategy
    holders = [strategy.store.home, getattr(strategy, "shards", None)]
    found = [files for holder in holders if (files := getattr(holder, "files", None)) is not None]
    return sum(f.bytes_read for f in found), sum(f.bytes_written for f in found)


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
    argv = sys.argv[1:] if argv is None else argv
    if any(arg == "--device" or arg.startswith("--device=") for arg in argv):  # ZeRO-Offload on one GPU (or its
        from .offload_gpu import main as on_device  # tiny CPU version): benchmarks/offload_gpu.py

        on_device(argv)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=10, help="millions of parameters (1000x1000 layers)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--stage", type=int, choices=(2, 3), default=2)
    parser.add_argument("--sub-group", type=int, default=262_144)
    parser.add_argument("--buffers", type=int, default=4)
    parser.add_argument("--max-in-cpu", type=int, default=0, help="offload_param.max_in_cpu (stage 3)")
    parser.add_argument("--bf16", action="store_true", help="bf16 compute (fp32 masters)")
    parser.add_argument("--ratio", type=float, default=1.0, help="offload_optimizer.ratio (the share offloaded)")
    parser.add_argument("--nvme", default=None, help="folder on the disk to offload to (default: a temp folder)")
    args = parser.parse_args(argv)
    nvme = args.nvme or tempfile.mkdtemp(prefix="offload-bench-")
    write, read = disk_bandwidth(nvme)
    print(f"disk under {nvme}: write {write:.0f} MiB/s (fsync'd), read {read:.0f} MiB/s (page cache dropped)")
    for what in SETTINGS[args.stage]:
        ranks = run_distributed(measure, 2, args=(args.params, args.steps, nvme, args.sub_group, args.buffers,
                                                  args.stage, what, args.max_in_cpu, args.bf16, args.ratio),
                                 timeout=600)
        for rank, r in enumerate(ranks):
            print(f"stage {args.stage} offload {what:9} rank {rank}: peak RSS {r['peak_rss'] / 2**20:.0f} MiB "
                  f"(+{r['growth'] / 2**20:.0f} MiB over before initialize; training peak "
                  f"+{r['train_peak'] / 2**20:.0f}; after the steps +{r['held'] / 2**20:.0f}, "
                  f"+{r['trimmed'] / 2**20:.0f} after malloc_trim), step {r['step_ms']:.0f} ms, read "
                  f"{r['read_per_step'] / 1e6:.1f} MB written {r['written_per_step'] / 1e6:.1f} MB per step "
                  f"(theory {r['theory'][0] / 1e6:.1f} / {r['theory'][1] / 1e6:.1f} MB for {r['shard']:,} elements, "
                  f"{r['resident']:,} of them resident)")


if __name__ == "__main__":
    main()
