"""Pipeline benchmark: the bubble, step time against ZeRO stage 0, parameter bytes per rank.

    python -m benchmarks.pipeline                  # the 40M GPT, 2 gloo ranks
    python -m benchmarks.pipeline --size tiny --micro-batches 1 2 --steps 1

On 2 ranks, the GPT of ``examples/train_gpt_pipe.py`` (its layer specs, tied
embedding and head) runs as a 2-stage pipeline, and the same layers as one
module (``to_sequential()``) run data-parallel at ZeRO stage 0.  Both engines
live in the same processes and their timed steps alternate, so a change in
the machine's load falls on both alike.  For each number of micro-batches M:

* **idle** is each stage's share of the schedule's span (first action on any
  stage to last action on any stage) spent outside its forwards and
  backwards: the bubble, plus waiting on transfers; next to 1F1B's
  ``(S - 1) / (M + S - 1)``, which holds for any forward:backward cost ratio
  when the stages cost the same (``simulate`` in ``tests/test_pipe_module.py`` reproduces it);
* **step ms** of the pipeline (M micro-batches on one replica) and of stage 0
  (M / 2 micro-batches on each of the 2 ranks): the same global batch; the
  slowest rank's time, median over the timed steps;
* **parameter bytes** each rank holds, and all of its training state
  (parameters, gradients, optimizer state), against the unsplit model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from shardwise.testing import run_distributed

from .configs import Workload
from .workload import batch, gpt_module, synthetic_stream

__all__ = ["main", "measure"]

STAGES = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pipeline", description=__doc__.split("\n")[0])
    p.add_argument("--size", default="40m", help="GPT preset (tiny, small, 10m, 40m)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--micro-batches", nargs="+", type=int, default=[1, 2, 4, 8], help="values of M")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per M")
    p.add_argument("--steps", type=int, default=3, help="timed steps per M and engine")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed for the launch")
    p.add_argument("--out", default=None, help="also write the results as JSON to this file")
    return p


def _layers(size: str) -> tuple[list[Any], Any]:
    gpt_module()  # puts examples/ on sys.path
    import train_gpt_pipe

    cfg = gpt_module().gpt_config(size)
    return train_gpt_pipe.gpt_layers(cfg), gpt_module().lm_loss


def _config(micro: int, accumulation: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 0},
    }


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _timed(step: Callable[[], Any]) -> float:
    dist.barrier()
    start = time.perf_counter()
    step()
    return _slowest(time.perf_counter() - start)


def _param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def measure(size: str, micro: int, counts: Sequence[int], warmup: int, steps: int) -> dict[str, Any]:
    """One rank's part of the benchmark (run on 2 ranks); see the module docstring."""
    import shardwise
    from shardwise.pipe import PipelineModule

    rank = dist.get_rank()
    layers, loss_fn = _layers(size)
    stream = synthetic_stream(1234)
    pipe_module = PipelineModule(layers, num_stages=STAGES, loss_fn=loss_fn, partition_method="type:Block", seed_layers=True)
    whole = PipelineModule(layers, loss_fn=loss_fn, seed_layers=True).to_sequential()
    result: dict[str, Any] = {
        "rank": rank, "stage": pipe_module.stage_id, "layers": list(pipe_module.stage_layers()),
        "param_bytes": {"pipeline": _param_bytes(pipe_module), "unsplit": _param_bytes(whole)}, "rows": [],
    }
    for count in counts:
        pipe = shardwise.initialize(pipe_module, config=_config(micro, count))
        work = Workload(size=size, world_size=1, micro_batch=micro)
        data = (batch(stream, work, 0, i) for i in range(10**9))
        row: dict[str, Any] = {"M": count, "pipeline_ms": [], "idle": [], "stage0_ms": []}
        stage0 = None
        if count % STAGES == 0:
            stage0 = shardwise.initialize(whole, config=_config(micro, count // STAGES))
        spread = Workload(size=size, world_size=STAGES, micro_batch=micro)
        index = 0
        for step in range(warmup + steps):
            elapsed = _timed(lambda: pipe.train_batch(data))
            span = _slowest(pipe.timing.total)  # the schedule ends when its last stage does
            if step >= warmup:
                row["pipeline_ms"].append(elapsed * 1e3)
                row["idle"].append(1.0 - pipe.timing.compute / span)
            if stage0 is not None:
                def dp_step() -> None:
                    nonlocal index
                    for _ in range(count // STAGES):
                        x, y = batch(stream, spread, rank, index)
                        index += 1
                        stage0.backward(stage0(x, y))
                        stage0.step()

                elapsed = _timed(dp_step)
                if step >= warmup:
                    row["stage0_ms"].append(elapsed * 1e3)
        row["state_bytes"] = {"pipeline": sum(pipe.memory_breakdown().values())}
        if stage0 is not None:
            row["state_bytes"]["stage0"] = sum(stage0.memory_breakdown().values())
            stage0.destroy()
        pipe.destroy()
        result["rows"].append(row)
    return result


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The markdown tables (rank 0's timings: they are already the slowest rank's)."""
    first = results[0]
    lines = [
        f"Pipeline benchmark: GPT {args.size}, {STAGES} stages on {STAGES} gloo ranks ({args.threads} thread each), "
        f"micro-batch {args.micro_batch}, {args.steps} timed steps after {args.warmup} warm-up; torch {torch.__version__}.",
        "",
        "| M | idle, stage 0 / 1 (measured) | (S-1)/(M+S-1) | pipeline step ms | stage 0 step ms | pipeline / stage 0 |",
        "|---|---|---|---|---|---|",
    ]
    for index, row in enumerate(first["rows"]):
        idle = " / ".join(f"{_median(r['rows'][index]['idle']):.2f}" for r in results)
        theory = (STAGES - 1) / (row["M"] + STAGES - 1)
        pipe, dp = _median(row["pipeline_ms"]), _median(row["stage0_ms"])
        ratio = f"{pipe / dp:.2f}x" if row["stage0_ms"] else "-"
        dp_text = f"{dp:.0f}" if row["stage0_ms"] else "- (M odd)"
        lines.append(f"| {row['M']} | {idle} | {theory:.2f} | {pipe:.0f} | {dp_text} | {ratio} |")
    lines += ["", "| rank | stage | layers | parameter MiB (pipeline / unsplit) | training state MiB (pipeline / stage 0) |",
              "|---|---|---|---|---|"]
    mib = 1 << 20
    for r in results:
        state = r["rows"][-1]["state_bytes"]
        dp_state = f"{state['stage0'] / mib:.1f}" if "stage0" in state else "-"
        span = f"{r['layers'][0]}-{r['layers'][-1]}"
        lines.append(
            f"| {r['rank']} | {r['stage']} | {span} | {r['param_bytes']['pipeline'] / mib:.1f} / "
            f"{r['param_bytes']['unsplit'] / mib:.1f} | {state['pipeline'] / mib:.1f} / {dp_state} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    results = run_distributed(
        measure, STAGES, args=(args.size, args.micro_batch, args.micro_batches, args.warmup, args.steps),
        timeout=args.timeout, threads_per_rank=args.threads,
    )
    print(report(results, args), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "ranks": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
