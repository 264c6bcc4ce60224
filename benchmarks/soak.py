"""Soak: thousands of steps at every ZeRO stage, watching memory, live tensors and step time.

    python -m benchmarks.soak                          # 2,000 steps per stage, tiny GPT, 2 gloo ranks
    python -m benchmarks.soak --steps 300 --stages 3   # shorter, one stage
    python -m benchmarks.soak --cost --size small      # what the fault machinery costs per step

**Soak.**  For each stage, one engine trains the GPT of ``examples/gpt.py`` on
the benchmark's synthetic stream for ``--steps`` steps (fp32, AdamW, 2 ranks).
After a warm-up (the first ``--warmup`` fraction of the steps: allocator pools,
lazily built buffers), every rank samples at ``--samples`` evenly spaced steps:

* **resident memory** (``/proc/self/statm``): growth from the end of the
  warm-up to the largest later sample, in percent (a leak grows with steps;
  the bar is 2%);
* **live tensors**: Python tensor objects the garbage collector tracks (a
  collection first), at the end of the warm-up and at the end (the bar: no
  growth);
* **step time**: median of the first and of the last tenth of the steps after
  warm-up, and their ratio (stable: near 1; this shared machine swings ±15%).

**Cost** (``--cost``).  One engine per stage trains in timed rounds that
alternate three modes in the same processes, so load changes fall on all alike:
``bare`` (the per-collective ledger and the per-step check switched off in
place), ``default`` (what always runs) and ``debug`` (``comms.debug``: a check
before every collective).  Reported: median step time per mode over the
rounds, and the overheads of ``default`` and ``debug`` against ``bare``.

Results go to ``--out`` (default ``bench_out/soak.json`` or ``bench_out/fault_cost.json``)
and are printed as a table.  ``tests/test_faults_soak.py`` runs the soak short.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from shardwise.testing import run_distributed

from .configs import Workload
from .workload import batch, build_model, synthetic_stream

__all__ = ["cost_in_rank", "main", "soak_in_rank", "soak_stages_in_rank", "summarize"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MODES = ("bare", "default", "debug")


def resident_bytes() -> int:
    """This process's resident set size now (not the peak)."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * _PAGE


def live_tensors() -> int:
    """Tensor objects alive in this process, after a full collection."""
    gc.collect()
    return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))


def _engine(stage: int, workload: Workload, comms: Optional[dict[str, Any]] = None) -> Any:
    import shardwise

    model = build_model(workload)
    config: dict[str, Any] = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": workload.micro_batch,
                              "optimizer": {"type": "AdamW", "params": {"lr": workload.lr}}}
    if comms:
        config["comms"] = comms
    return shardwise.initialize(model, config=config)


def _step(engine: Any, stream: torch.Tensor, workload: Workload, step: int) -> float:
    x, y = batch(stream, workload, dist.get_rank(), step)
    start = time.perf_counter()
    _, loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return time.perf_counter() - start


# -------------------------------------------------------------------- soak
def soak_in_rank(stage: int, steps: int, warmup: float, samples: int, size: str, seq_len: int = 0) -> dict[str, Any]:
    """Train ``steps`` steps at ``stage`` and sample memory, tensors and step time (runs on every rank)."""
    workload = Workload(size=size, world_size=dist.get_world_size(), micro_batch=2, seq_len=seq_len)
    stream = synthetic_stream(workload.seed)
    engine = _engine(stage, workload)
    first = max(1, int(steps * warmup))
    marks = set(range(first, steps + 1, max(1, (steps - first) // max(1, samples))))
    times: list[float] = []
    rss: list[tuple[int, int]] = []
    tensors_after_warmup = 0
    for step in range(1, steps + 1):
        elapsed = _step(engine, stream, workload, step)
        if step > first:
            times.append(elapsed)
        if step == first:
            tensors_after_warmup = live_tensors()
        if step in marks or step == steps:
            rss.append((step, resident_bytes()))
    tensors_at_end = live_tensors()
    engine.destroy()
    return {"stage": stage, "rank": dist.get_rank(), "steps": steps, "warmup_steps": first, "rss": rss,
            "tensors": [tensors_after_warmup, tensors_at_end], "times": times}


def soak_stages_in_rank(stages: Sequence[int], steps: int, warmup: float, samples: int, size: str,
                        seq_len: int = 0) -> list[dict[str, Any]]:
    """:func:`soak_in_rank` for each stage in turn, in one launch."""
    return [soak_in_rank(stage, steps, warmup, samples, size, seq_len) for stage in stages]


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """One rank's soak in the figures the report shows."""
    rss = result["rss"]
    base = rss[0][1]
    growth = (max(v for _, v in rss) - base) / base * 100.0
    times = result["times"]
    tenth = max(1, len(times) // 10)
    early, late = statistics.median(times[:tenth]), statistics.median(times[-tenth:])
    return {
        "stage": result["stage"], "rank": result["rank"], "steps": result["steps"],
        "rss_mib_after_warmup": round(base / 2**20, 1), "rss_growth_pct": round(growth, 2),
        "tensors_after_warmup": result["tensors"][0], "tensors_at_end": result["tensors"][1],
        "step_ms_early": round(early * 1e3, 2), "step_ms_late": round(late * 1e3, 2),
        "late_over_early": round(late / early, 3),
    }


# -------------------------------------------------------------------- cost
def cost_in_rank(stage: int, rounds: int, steps_per_round: int, size: str) -> dict[str, list[float]]:
    """Median step time of each mode in each round (runs on every rank; modes alternate per round)."""
    workload = Workload(size=size, world_size=dist.get_world_size(), micro_batch=2)
    stream = synthetic_stream(workload.seed)
    engine = _engine(stage, workload)
    comm, ledger = engine.comm, engine.comm.ledger
    switch = _Switch(comm, ledger)
    for step in range(3):  # warm-up: lazy buffers, the check group, the first gathers
        _step(engine, stream, workload, step)
    medians: dict[str, list[float]] = {mode: [] for mode in MODES}
    step = 3
    for _ in range(rounds):
        for mode in MODES:
            switch.set(mode)
            times = []
            for _ in range(steps_per_round):
                times.append(_step(engine, stream, workload, step))
                step += 1
            medians[mode].append(statistics.median(times))
    switch.set("default")
    engine.destroy()
    return medians


class _Switch:
    """Turns the always-on fault machinery of one engine off and on, in place (a measurement device)."""

    def __init__(self, comm: Any, ledger: Any) -> None:
        self.comm, self.ledger = comm, ledger
        self.record, self.check = ledger.record, comm.check
        self.entry = ledger.record("warm-up", 0, torch.float32, "")

    def set(self, mode: str) -> None:
        bare = mode == "bare"
        self.ledger.record = (lambda *args: self.entry) if bare else self.record
        self.comm.check = (lambda *args: None) if bare else self.check
        self.comm.debug = mode == "debug"


# -------------------------------------------------------------------- report
def _table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _machine() -> str:
    return f"{os.cpu_count()} CPU cores, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"


def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    per_rank = run_distributed(soak_stages_in_rank, args.world_size, timeout=args.timeout,
                               args=(args.stages, args.steps, args.warmup, args.samples, args.size))
    rows = [summarize(r) for results in zip(*per_rank) for r in results]
    columns = ["stage", "rank", "steps", "rss_mib_after_warmup", "rss_growth_pct", "tensors_after_warmup",
               "tensors_at_end", "step_ms_early", "step_ms_late", "late_over_early"]
    print(_table(rows, columns))
    return {"kind": "soak", "size": args.size, "world_size": args.world_size, "machine": _machine(), "rows": rows}


def run_cost(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for stage in args.stages:
        per_rank = run_distributed(cost_in_rank, args.world_size, args=(stage, args.rounds, args.steps_per_round,
                                                                       args.size), timeout=args.timeout)
        # the slowest rank sets the pace of a step
        slowest = {m: [max(r[m][i] for r in per_rank) for i in range(args.rounds)] for m in MODES}
        med = {m: statistics.median(v) for m, v in slowest.items()}
        spread = {m: (min(v), max(v)) for m, v in slowest.items()}
        rows.append({
            "stage": stage, **{f"{m}_ms": round(med[m] * 1e3, 2) for m in MODES},
            "default_overhead_pct": round((med["default"] / med["bare"] - 1) * 100, 2),
            "debug_overhead_pct": round((med["debug"] / med["bare"] - 1) * 100, 2),
            "bare_range_ms": f"{spread['bare'][0] * 1e3:.1f}-{spread['bare'][1] * 1e3:.1f}",
        })
    columns = ["stage", *[f"{m}_ms" for m in MODES], "default_overhead_pct", "debug_overhead_pct", "bare_range_ms"]
    print(_table(rows, columns))
    return {"kind": "cost", "size": args.size, "world_size": args.world_size, "rounds": args.rounds,
            "steps_per_round": args.steps_per_round, "machine": _machine(), "rows": rows}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cost", action="store_true", help="measure the fault machinery's cost per step instead")
    parser.add_argument("--size", default="tiny", help="GPT preset of examples/gpt.py (default tiny)")
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2000, help="soak: steps per stage")
    parser.add_argument("--warmup", type=float, default=0.1, help="soak: fraction of steps before measuring")
    parser.add_argument("--samples", type=int, default=20, help="soak: memory samples after warm-up")
    parser.add_argument("--rounds", type=int, default=7, help="cost: rounds of the three modes")
    parser.add_argument("--steps-per-round", type=int, default=8, help="cost: steps per mode per round")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--out", type=Path, default=None)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    report = run_cost(args) if args.cost else run_soak(args)
    out = args.out or Path("bench_out") / ("fault_cost.json" if args.cost else "soak.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

