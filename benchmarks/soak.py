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
  collection first, and the collectives in flight finished), at the end of
  the warm-up and at the end (the bar: no growth);
* **step time**: median of the first and of the last tenth of the steps after
  warm-up, and their ratio (stable: near 1; this shared machine swings ±15%).

**Cost** (``--cost``).  One engine per stage trains in timed rounds that
alternate three modes in the same processes, so load changes fall on all alike:
``bare`` (the per-collective ledger, the per-step check and the announcements
of forwards, backwards and calls switched off in place), ``default`` (what
always runs) and ``debug`` (``comms.debug``: a check before every collective).
Reported: median step time per mode over the rounds and the A/B overheads
against ``bare`` (on a shared machine a 1% effect drowns in the noise, so
also) the always-on part accounted piece by piece: collectives per step × the
time of one ledger entry, plus the control-group exchanges per step (the step
check and the announcements, each one exchange) × the time of one, each timed
on its own over many repetitions, against the ``bare`` step time.
(The heartbeat is one store write per interval on its own thread.)

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


def _settled_tensors(engine: Any) -> int:
    """Live tensors once the collectives in flight are done (stages 1-2 gather behind the next forward, and
    a shared-memory collective holds its tensors until its worker has run it): the same point every time."""
    engine.strategy.settle()
    return live_tensors()


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
            tensors_after_warmup = _settled_tensors(engine)
        if step in marks or step == steps:
            rss.append((step, resident_bytes()))
    tensors_at_end = _settled_tensors(engine)
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
def cost_in_rank(stage: int, rounds: int, steps_per_round: int, size: str) -> dict[str, Any]:
    """Step times per mode and round (modes alternate each round), and the parts timed one by one."""
    workload = Workload(size=size, world_size=dist.get_world_size(), micro_batch=2)
    stream = synthetic_stream(workload.seed)
    engine = _engine(stage, workload)
    switch = _Switch(engine.comm)
    for step in range(3):  # warm-up: lazy buffers, the check group, the first gathers
        _step(engine, stream, workload, step)
    medians: dict[str, list[float]] = {mode: [] for mode in MODES}
    step = 3
    for _ in range(rounds):
        for mode in MODES:
            switch.set(mode)
            times = [_step(engine, stream, workload, step + i) for i in range(steps_per_round)]
            step += steps_per_round
            medians[mode].append(statistics.median(times))
    switch.set("default")
    before, exchanges = engine.comm.ledger.seq, engine.comm.ledger.control.count
    _step(engine, stream, workload, step)
    parts = {"collectives_per_step": engine.comm.ledger.seq - before,
             "exchanges_per_step": engine.comm.ledger.control.count - exchanges, "record_us": _time_record(engine.comm) * 1e6,
             "check_us": _time_check(engine.comm) * 1e6, "heartbeat_interval_s": _heartbeat_interval()}
    engine.destroy()
    return {"medians": medians, "parts": parts}


def _time_record(comm: Any, calls: int = 20000) -> float:
    """Seconds per ledger entry (``Comm.record`` into a private ledger: the engine's sequence is left alone)."""
    from shardwise.faults.ledger import Ledger

    own, comm.ledger = comm.ledger, Ledger("bench", [0])
    try:
        start = time.perf_counter()
        for _ in range(calls):
            comm.record("all_gather", 4096, torch.float32, "`fc.weight` and 1 more")
        return (time.perf_counter() - start) / calls
    finally:
        comm.ledger = own


def _time_check(comm: Any, calls: int = 100) -> float:
    """Median seconds of one step check (every rank calls it the same number of times)."""
    times = []
    for index in range(calls):
        start = time.perf_counter()
        comm.check("the cost benchmark", [index], ["check"])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _heartbeat_interval() -> float:
    from shardwise.faults.heartbeat import heartbeat

    beat = heartbeat()
    return beat.interval if beat is not None else 0.0


class _Switch:
    """Turns the always-on fault machinery of one engine off and on, in place (a measurement device)."""

    def __init__(self, comm: Any) -> None:
        # the ledger's entries are made by `Comm.record`, and every announcement and step check is an exchange
        # through `Comm.agree` (the engine's backward and step call it directly)
        self.comm = comm
        self.record, self.check, self.agree = comm.record, comm.check, comm.agree
        self.entry = comm.record("warm-up", 0, torch.float32, "")

    def set(self, mode: str) -> None:
        bare = mode == "bare"
        self.comm.record = (lambda *args: self.entry) if bare else self.record
        self.comm.check = (lambda *args: None) if bare else self.check
        self.comm.agree = (lambda *args: None) if bare else self.agree
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
        rows.append(_cost_row(stage, per_rank, args.rounds))
    columns = ["stage", *[f"{m}_ms" for m in MODES], "bare_range_ms", "default_ab_pct", "debug_ab_pct",
               "collectives_per_step", "exchanges_per_step", "record_us", "check_us", "always_on_pct"]
    print(_table(rows, columns))
    return {"kind": "cost", "size": args.size, "world_size": args.world_size, "rounds": args.rounds,
            "steps_per_round": args.steps_per_round, "machine": _machine(), "rows": rows}


def _cost_row(stage: int, per_rank: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    # the slowest rank sets the pace of a step
    slowest = {m: [max(r["medians"][m][i] for r in per_rank) for i in range(rounds)] for m in MODES}
    med = {m: statistics.median(v) for m, v in slowest.items()}
    parts = per_rank[0]["parts"]
    record_us = max(r["parts"]["record_us"] for r in per_rank)
    check_us = max(r["parts"]["check_us"] for r in per_rank)
    # always on, accounted part by part: an entry per collective, and per step the step check and the
    # announcements (one control-group exchange each: what `check_us` times)
    exchanges = parts.get("exchanges_per_step", 1)
    always_on = (parts["collectives_per_step"] * record_us + exchanges * check_us) * 1e-6
    return {
        "stage": stage, **{f"{m}_ms": round(med[m] * 1e3, 2) for m in MODES},
        "bare_range_ms": f"{min(slowest['bare']) * 1e3:.1f}-{max(slowest['bare']) * 1e3:.1f}",
        "default_ab_pct": round((med["default"] / med["bare"] - 1) * 100, 1),
        "debug_ab_pct": round((med["debug"] / med["bare"] - 1) * 100, 1),
        "collectives_per_step": parts["collectives_per_step"], "exchanges_per_step": exchanges,
        "record_us": round(record_us, 2),
        "check_us": round(check_us, 1), "always_on_pct": round(always_on / med["bare"] * 100, 2),
    }


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

