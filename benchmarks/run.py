"""``python -m benchmarks.run``: shardwise against torch DDP / ZeRO-1 / FSDP2, and scaling.

Examples::

    python -m benchmarks.run --size 10m                       # the side-by-side table
    python -m benchmarks.run --size 40m --micro-batch 1 --rounds 2
    python -m benchmarks.run --scaling-only --scaling-sizes tiny small 10m --scaling-worlds 1 2 4
    python -m benchmarks.run --size tiny --steps 2 --rounds 1 --isolation round   # a smoke run

Writes ``comparison.{md,json,png}`` and/or ``scaling.{md,json,png}`` under ``--out``
and prints the markdown.  Exits 1 when a shardwise or torch system failed or
the losses disagree, so a CI job notices.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from .chart import comparison_chart, scaling_chart
from .configs import DTYPES, System, Workload, available_stages, comparison_systems
from .report import comparison_markdown, machine, scaling_markdown, write_json
from .schedule import ISOLATIONS, run_rounds
from .summary import compare, loss_check, summarize
from .workload import model_numel, seq_len

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    p.add_argument("--size", default="10m", help="GPT preset for the comparison (tiny, small, 10m, 40m)")
    p.add_argument("--world-size", type=int, default=2, help="ranks (gloo processes)")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=0, help="tokens per sequence; 0: the model's block_size")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of every round")
    p.add_argument("--steps", type=int, default=3, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each system once per round)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    p.add_argument("--stages", nargs="+", type=int, default=None, help="default: every stage shardwise has")
    p.add_argument("--no-peers", action="store_true", help="shardwise only")
    p.add_argument("--deepspeed", action="store_true", help="add DeepSpeed (must be importable)")
    p.add_argument("--isolation", choices=ISOLATIONS, default="pair",
                   help="pair: each stage with its peers, steps alternating; process: fresh ranks per system "
                        "per round; round: one launch per round (fast smoke runs)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per system and launch")
    p.add_argument("--out", default="bench_out", help="output directory")
    p.add_argument("--no-chart", action="store_true")
    p.add_argument("--scaling", action="store_true", help="also run the scaling sweep")
    p.add_argument("--scaling-only", action="store_true", help="run only the scaling sweep")
    p.add_argument("--scaling-sizes", nargs="+", default=["tiny", "small", "10m"])
    p.add_argument("--scaling-worlds", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--scaling-steps", type=int, default=3)
    p.add_argument("--scaling-dtype", choices=DTYPES, default="fp32")
    return p


def _workload(args: argparse.Namespace, size: str, world_size: int, steps: int) -> Workload:
    return Workload(size=size, world_size=world_size, micro_batch=args.micro_batch, seq_len=args.seq_len,
                    warmup=args.warmup, steps=steps, seed=args.seed, lr=args.lr)


def _load() -> tuple[float, ...] | None:
    return os.getloadavg() if hasattr(os, "getloadavg") else None


def run_comparison(args: argparse.Namespace, out: Path, command: str) -> dict[str, Any]:
    """Every system, interleaved; writes comparison.{json,md,png}."""
    stages = args.stages if args.stages is not None else available_stages()
    systems = comparison_systems(stages, tuple(args.dtypes), peers=not args.no_peers, deepspeed=args.deepspeed)
    workload = _workload(args, args.size, args.world_size, args.steps)
    numel = model_numel(args.size)
    print(f"comparison: GPT {args.size} ({numel / 1e6:.2f}M), {len(systems)} systems × {args.rounds} rounds")
    load_before = _load()
    outcomes = run_rounds(systems, workload, args.rounds, isolation=args.isolation,
                          timeout=args.timeout, threads=args.threads)
    summaries = [summarize(outcomes[s], numel) for s in systems]
    result = {
        "command": command, "machine": machine(), "workload": workload.as_dict(), "seq_len": seq_len(workload),
        "numel": numel, "rounds": args.rounds, "isolation": args.isolation, "threads": args.threads,
        "load_before": load_before, "load_after": _load(),
        "systems": summaries, "comparisons": compare(summaries), "loss_check": loss_check(summaries),
    }
    if args.deepspeed:
        result["deepspeed_comparisons"] = compare(summaries, against="deepspeed")
    _write_report(out, "comparison", result, comparison_markdown, None if args.no_chart else comparison_chart)
    return result


def run_scaling(args: argparse.Namespace, out: Path, command: str) -> dict[str, Any]:
    """Shardwise stages at every (size, world size); writes scaling.{json,md,png}."""
    stages = args.stages if args.stages is not None else available_stages()
    points = []
    for size in args.scaling_sizes:
        numel = model_numel(size)
        for world in args.scaling_worlds:
            workload = _workload(args, size, world, args.scaling_steps)
            systems = [System("shardwise", stage, args.scaling_dtype) for stage in stages]
            print(f"scaling: GPT {size} ({numel / 1e6:.2f}M) on {world} rank(s)")
            outcomes = run_rounds(systems, workload, 1, isolation=args.isolation,
                                  timeout=args.timeout, threads=args.threads)
            for system in systems:
                point = summarize(outcomes[system], numel)
                points.append({**point, "size": size, "world_size": world, "numel": numel})
    result = {"command": command, "machine": machine(), "dtype": args.scaling_dtype,
              "micro_batch": args.micro_batch, "threads": args.threads, "points": points}
    _write_report(out, "scaling", result, scaling_markdown, None if args.no_chart else scaling_chart)
    return result


def _write_report(out: Path, name: str, result: dict[str, Any], markdown: Any, chart: Any) -> None:
    """``name``.json and ``name``.md (printed too), and ``name``.png when ``chart`` is given."""
    write_json(out / f"{name}.json", result)
    text = markdown(result)
    (out / f"{name}.md").write_text(text, encoding="utf-8")
    print(text)
    if chart is not None and chart(result, out / f"{name}.png"):
        print(f"chart: {out / f'{name}.png'}")


def _healthy(result: dict[str, Any]) -> bool:
    """No shardwise or torch system failed (DeepSpeed may), and the losses agree."""
    failed = [s["name"] for s in result["systems"]
              if ("error" in s or "failure" in s) and s["family"] != "deepspeed"]
    if failed:
        print(f"failed systems: {', '.join(failed)}", file=sys.stderr)
    if not result["loss_check"]["agree"]:
        print("losses disagree across systems: see the Losses section", file=sys.stderr)
    return not failed and result["loss_check"]["agree"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m benchmarks.run", *map(shlex.quote, argv)])
    healthy = True
    if not args.scaling_only:
        healthy = _healthy(run_comparison(args, out, command))
    if args.scaling or args.scaling_only:
        scaling = run_scaling(args, out, command)
        healthy = healthy and all("error" not in p for p in scaling["points"])
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
