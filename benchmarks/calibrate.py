"""``python -m benchmarks.calibrate``: measure this machine for the cost model (:mod:`benchmarks.model`).

* α, β of gloo on loopback: all-reduce of 16 KiB to 64 MiB on 2 ranks (1 torch
  thread each, as the benchmark runs), median of 5 per size; a least-squares
  line t = a + b·S gives α = a / (2(N−1)) and β = b / (2(N−1)/N).
* Sustained FLOP/s of one rank: forward + backward of the benchmark's GPT
  (``--size``, fp32, micro-batch 1), counted as :meth:`Transformer.flops_per_token`.
* Memory bandwidth as the optimizer sees it: one AdamW step over 8M fp32
  parameters, counted as the model counts it (2 × 16 bytes per parameter).

Writes ``benchmarks/calibration.json`` (``--out`` to write elsewhere).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["main", "measure_collectives"]

_SIZES = [1 << k for k in range(14, 27, 2)]  # 16 KiB .. 64 MiB


def measure_collectives(sizes: list[int], repeats: int = 5) -> list[tuple[int, float]]:
    """On every rank: (bytes, median seconds) of an fp32 all-reduce per size (collective)."""
    import torch.distributed as dist

    timings = []
    for nbytes in sizes:
        tensor = torch.ones(nbytes // 4)
        dist.all_reduce(tensor)  # warm-up: connections and buffers
        samples = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            samples.append(time.perf_counter() - start)
        timings.append((nbytes, statistics.median(samples)))
    return timings


def _fit(points: list[tuple[int, float]], n: int) -> tuple[float, float]:
    """α, β from all-reduce timings: t = 2(N−1)α + 2(N−1)/N·S·β, fitted by least squares."""
    xs, ys = [float(s) for s, _ in points], [t for _, t in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = max(my - slope * mx, 0.0)
    return intercept / (2 * (n - 1)), slope / (2 * (n - 1) / n)


def measure_flops(size: str) -> float:
    """Sustained FLOP/s of forward + backward of the GPT ``size`` on this thread (fp32, one sequence)."""
    from .model import gpt_preset
    from .workload import gpt_module

    gpt = gpt_module()
    torch.manual_seed(0)
    model = gpt.GPT(gpt.gpt_config(size))
    shape = gpt_preset(size)
    x = torch.randint(0, shape.vocab, (1, shape.seq))
    samples = []
    for step in range(4):
        start = time.perf_counter()
        _, loss = model(x, x)
        loss.backward()
        if step:  # the first step pays for allocations
            samples.append(time.perf_counter() - start)
    return shape.flops_per_token() * shape.seq / statistics.median(samples)


def measure_bandwidth(numel: int = 8_000_000) -> float:
    """Bytes/s an fp32 AdamW step moves, counting 2 × 16 bytes per parameter (as the model does)."""
    param = torch.nn.Parameter(torch.zeros(numel))
    param.grad = torch.ones(numel)
    opt = torch.optim.AdamW([param], lr=1e-3)
    opt.step()
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        opt.step()
        samples.append(time.perf_counter() - start)
    return numel * 16 * 2 / statistics.median(samples)


def _rank_measure() -> list[tuple[int, float]]:
    torch.set_num_threads(1)
    return measure_collectives(_SIZES)


def main(argv: list[str] | None = None) -> int:
    from shardwise.testing import run_distributed

    from .model import HERE

    parser = argparse.ArgumentParser(prog="python -m benchmarks.calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="10m", help="GPT preset timed for FLOP/s")
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args(argv)
    points = run_distributed(_rank_measure, world_size=2, timeout=300)[0]
    alpha, beta = _fit(points, 2)
    torch.set_num_threads(1)
    result: dict[str, Any] = {
        "alpha": alpha, "beta": beta, "flops": measure_flops(args.size), "bandwidth": measure_bandwidth(),
        "all_reduce_points": points, "flops_size": args.size,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"), "torch": torch.__version__,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"alpha {alpha * 1e6:.1f} us, beta {1 / beta / 1e9:.2f} GB/s, {result['flops'] / 1e9:.1f} GFLOP/s, "
          f"optimizer bandwidth {result['bandwidth'] / 1e9:.2f} GB/s -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
