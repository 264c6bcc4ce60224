"""``python -m benchmarks.profile``: where one system's step time goes, on rank 0.

Trains one system as the runner does, then profiles its timed steps twice:
with ``cProfile`` (Python functions: which ``file:function`` of shardwise or
torch spends the time) and with ``torch.profiler`` (operators: matmuls,
copies, collectives).  Example::

    python -m benchmarks.profile --system shardwise-s1-fp32 --size 10m

prints both tables and writes them to ``--out`` (``profile-<system>.txt``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardwise.testing import run_distributed

from .configs import FAMILIES, System, Workload, available_stages, comparison_systems
from .systems import build_harness
from .workload import batch, build_model, synthetic_stream

__all__ = ["main", "profile_system"]


def _by_name(name: str) -> System:
    systems = comparison_systems(available_stages(), deepspeed=True)
    for system in systems:
        if system.name == name:
            return system
    raise SystemExit(f"unknown system `{name}`; expected one of {', '.join(s.name for s in systems)}")


def profile_system(system: System, workload: Workload, top: int) -> str | None:
    """Rank body: warm up, then cProfile and torch.profiler over ``workload.steps`` each."""
    rank = dist.get_rank()
    stream = synthetic_stream(workload.seed)
    harness = build_harness(system, build_model(workload), workload)
    step = 0

    def run(count: int) -> float:
        nonlocal step
        begin = time.perf_counter()
        for _ in range(count):
            x, y = batch(stream, workload, rank, step)
            harness.step(x, y, measure=False)
            step += 1
        return (time.perf_counter() - begin) / count

    run(workload.warmup)
    plain = run(workload.steps)
    profiler = cProfile.Profile()
    profiler.enable()
    profiled = run(workload.steps)
    profiler.disable()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as ops:
        run(workload.steps)
    if rank != 0:
        return None
    header = f"{system.name}: {1000 * plain:.1f} ms/step unprofiled, {1000 * profiled:.1f} ms/step under cProfile"
    return "\n\n".join([header, _python_table(profiler, top), _op_table(ops, top)])


def _python_table(profiler: cProfile.Profile, top: int) -> str:
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return "Python functions (cProfile, all timed steps):\n" + text.getvalue()


def _op_table(ops: Any, top: int) -> str:
    table = ops.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    return "Operators (torch.profiler, all timed steps):\n" + table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__.split("\n")[0])
    p.add_argument("--system", required=True, help=f"a system name, e.g. shardwise-s1-fp32 ({'/'.join(FAMILIES)})")
    p.add_argument("--size", default="10m")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="steps per profiler (and unprofiled) window")
    p.add_argument("--top", type=int, default=30, help="rows per table")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="bench_out")
    args = p.parse_args(argv)
    system = _by_name(args.system)
    workload = Workload(size=args.size, world_size=args.world_size, micro_batch=args.micro_batch,
                        warmup=args.warmup, steps=args.steps)
    results = run_distributed(profile_system, world_size=args.world_size, args=(system, workload, args.top),
                              timeout=1800, threads_per_rank=args.threads)
    report = results[0]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile-{system.name}.txt").write_text(report, encoding="utf-8")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
