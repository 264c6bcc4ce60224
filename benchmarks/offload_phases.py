"""Where an offloaded stage 3 GPT's host memory goes, phase by phase: what ``offload_capacity`` measures, split.

``python -m benchmarks.offload_phases [--layers 10,20,40] [--settings both,none] [--nvme DIR]`` builds the same
GPT as :mod:`benchmarks.offload_capacity` (same config: 2 ranks, AdamW fp32, NVMe offload of both with
``max_in_cpu`` 0, ``stage3_max_live_parameters`` 20M) and records, on each rank, after each phase (the model
built under ``zero.Init``, ``initialize``, each step's forward, backward and step, ``engine.destroy()``) the resident memory
over the process before the build: ``VmRSS`` now and the peak of that phase alone (``VmHWM`` reset before
it), split into anonymous, file-backed and shared memory, with glibc's heap figures (``mallinfo2``).  A
line per layer count fits, per phase, bytes per layer across the counts.
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile
from typing import Any, Optional

import torch

import shardwise
from shardwise.testing import run_distributed

from .offload import _zero
from .worker import _reset_peak_rss, rss_bytes
from .workload import gpt_module

__all__ = ["main", "phases"]

_M_MMAP_THRESHOLD = -3
_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _heap() -> dict[str, int]:
    """glibc's ``mallinfo2``: heap bytes in use, free inside the heap, and in mmapped blocks."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return {"heap_used": info.uordblks, "heap_free": info.fordblks, "mmapped": info.hblkhd}


def _sample(base: dict[str, int]) -> dict[str, int]:
    now = {name: rss_bytes(name) for name in _FIELDS}
    return {**{k: v - base.get(k, 0) for k, v in now.items()}, **_heap()}


def phases(layers: int, what: str, nvme: str, steps: int = 3) -> list[tuple[str, dict[str, int]]]:
    """One rank: the memory after (and peak during) each phase of building and training the GPT."""
    ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 1 << 20)
    base = {name: rss_bytes(name) for name in _FIELDS}
    base["VmHWM"] = base["VmRSS"]
    out: list[tuple[str, dict[str, int]]] = []

    def mark(name: str) -> None:
        out.append((name, _sample(base)))
        _reset_peak_rss()

    _reset_peak_rss()
    gpt = gpt_module()
    zero = _zero(3, what, nvme, 1_000_000, 4, 0)
    zero.update(stage3_max_reuse_distance=0, stage3_max_live_parameters=20_000_000)
    config = {"zero_optimization": zero, "train_micro_batch_size_per_gpu": 1}
    torch.manual_seed(0)
    with shardwise.zero.Init(config=config):
        model = gpt.GPT(gpt.GPTConfig(vocab_size=256, block_size=64, n_layer=layers, n_head=16, n_embd=1024))
    mark("built")
    engine = shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)
    mark("initialize")
    idx = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(0))
    for step in range(steps):
        _, loss = engine(idx, idx)
        mark(f"fwd{step + 1}")
        engine.backward(loss)
        mark(f"bwd{step + 1}")
        engine.step()
        mark(f"step{step + 1}")
    del loss
    engine.destroy()
    mark("destroy")
    return out


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="10,20,40")
    parser.add_argument("--settings", default="both")
    parser.add_argument("--nvme", default=None)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    nvme = args.nvme or tempfile.mkdtemp(prefix="offload-phases-")
    counts = [int(n) for n in args.layers.split(",")]
    mib = 2**20
    for what in args.settings.split(","):
        runs: dict[int, list[Any]] = {}
        for count in counts:
            ranks = run_distributed(phases, 2, args=(count, what, nvme, args.steps), timeout=3600)
            runs[count] = ranks
            for rank, rows in enumerate(ranks):
                print(f"{what} {count} layers rank {rank}:")
                for name, row in rows:
                    print(f"  {name:10} rss {row['VmRSS'] / mib:7.0f} peak {row['VmHWM'] / mib:7.0f} "
                          f"anon {row['RssAnon'] / mib:7.0f} file {row['RssFile'] / mib:6.0f} "
                          f"shm {row['RssShmem'] / mib:6.0f} | heap used {row['heap_used'] / mib:7.0f} "
                          f"free {row['heap_free'] / mib:6.0f} mmapped {row['mmapped'] / mib:7.0f} MiB", flush=True)
        if len(counts) > 1:
            lo, hi = counts[0], counts[-1]
            for rank in range(2):
                print(f"{what} rank {rank}: MiB per layer ({lo} -> {hi} layers), rss / phase peak")
                for (name, a), (_, b) in zip(runs[lo][rank], runs[hi][rank]):
                    print(f"  {name:10} {(b['VmRSS'] - a['VmRSS']) / mib / (hi - lo):6.2f} "
                          f"{(b['VmHWM'] - a['VmHWM']) / mib / (hi - lo):6.2f}")


if __name__ == "__main__":
    main()
