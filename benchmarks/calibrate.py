"""``python -m benchmarks.calibrate``: measure this machine for the cost model (:mod:`benchmarks.model`).

* α, β of gloo on loopback: all-reduce of 16 KiB to 64 MiB on 2 ranks (1 torch
  thread each, as the benchmark runs), median of 5 per size; a least-squares
  line t = a + b·S gives α = a / (2(N−1)) and β = b / (2(N−1)/N).
* The same through shardwise's shared memory (what its engine uses on one
  host, ``shardwise.shm``): ``Comm.all_reduce`` of a region of a buffer every
  rank maps, as the flat stages reduce their gradients; and an all-gather of a
  private tensor, staged through the segment's slots, as parameters are
  gathered. Comm's own host work per collective is in the figures.
* Sustained FLOP/s of one rank: forward + backward of the benchmark's GPT
  (``--size``, fp32, micro-batch 1), counted as :meth:`Transformer.flops_per_token`;
  and, for each preset the validation uses, the bare model's FLOP/s and
  AdamW's bandwidth over its own parameters (device figures for that shape, as
  a datasheet's are for a GPU: small matrices run slower on a CPU, AdamW's
  passes over small tensors stay in cache), alone and with both ranks
  measuring at once (2 ranks share the caches and the memory bus).
* Memory bandwidth as the optimizer sees it: one AdamW step over 8M fp32
  parameters, counted as the model counts it (2 × 16 bytes per parameter).
* Host work per parameter tensor, per stage: one rank trains the ``tiny`` GPT
  (a preset the validation does not use) through an engine at that stage;
  what its step time has beyond the compute and optimizer terms (with tiny's
  own device figures), divided by its parameter tensors.  And the same with 2
  ranks beyond everything the model predicts for them with the links measured
  above (the ranks waiting for each other at every collective, on top).

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
#: the presets whose compute rate is measured on its own (matrix size sets a CPU's FLOP rate)
_FLOP_SIZES = ("small", "10m", "40m")


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


def measure_shared_memory(sizes: list[int], repeats: int = 5, gather: bool = False) -> list[tuple[int, float]]:
    """On every rank: (bytes, median seconds) of an fp32 all-reduce through shared memory of a region of a
    shared buffer, or (``gather``) an all-gather of a private tensor into ``bytes`` (collective)."""
    import torch.distributed as dist

    from shardwise.distributed import Comm

    comm = Comm(None)
    comm.open_shared_memory()
    if not comm.shared_memory:
        return []
    buffer = comm.shared_zeros(max(sizes) // 4, torch.float32, torch.device("cpu"))
    timings = []
    for nbytes in sizes:
        region = buffer[: nbytes // 4]
        output, part = torch.zeros(nbytes // 4), torch.ones(nbytes // 4 // comm.world_size)
        samples = []
        for attempt in range(repeats + 1):  # the first is a warm-up
            dist.barrier()
            start = time.perf_counter()
            comm.all_gather(output, part) if gather else comm.all_reduce(region)
            if attempt:
                samples.append(time.perf_counter() - start)
        timings.append((nbytes, statistics.median(samples)))
    return timings


def measure_host_overhead(stage: int, cluster: Any, size: str = "tiny") -> float:
    """Seconds per parameter tensor per step beyond what ``cluster`` predicts for ``size`` at ``stage``
    (every rank of the current group trains; a collective with 2 ranks).

    With one rank and :func:`bare_cluster` of the ``size`` model's own FLOP rate and AdamW bandwidth, what
    remains is the engine's host work (hooks, unit bookkeeping at stage 3, the optimizer's loop).  With 2
    ranks and a cluster of the measured links, what remains is also the ranks waiting for each other."""
    import torch.distributed as dist

    import shardwise

    from .model import Job, gpt_preset, step_time
    from .workload import gpt_module

    gpt = gpt_module()
    torch.manual_seed(0)
    model = gpt.GPT(gpt.gpt_config(size))
    # every tensor its own gathered unit at stage 3 (tiny's are all below the default persistence threshold,
    # which would leave the unit machinery out of the figure)
    zero: dict[str, Any] = {"stage": stage} | ({"stage3_param_persistence_threshold": 0} if stage == 3 else {})
    engine = shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"zero_optimization": zero})
    shape = gpt_preset(size)
    x = torch.randint(0, shape.vocab, (1, shape.seq))

    def train_step() -> None:
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()

    measured = _median_seconds(train_step, steps=10, warmup=2)
    engine.destroy()
    n = dist.get_world_size() if dist.is_initialized() else 1
    job = Job(shape, param_bytes=4, grad_bytes=4, state_bytes=8, checkpointing=False)
    modelled = step_time(job, stage, n, cluster)["total"]
    return max(measured - modelled, 0.0) / shape.tensors


def bare_cluster(device: dict[str, float]) -> Any:
    """One rank with ``device``'s FLOP rate and bandwidth, and no links."""
    from .collectives import Link
    from .model import GB, Cluster, Device

    bare = Device("bare", device["flops"], 24 * GB, device["bandwidth"], "calibration")
    none = Link("none", 0.0, 0.0, "calibration")
    return Cluster("one rank", bare, 1, none, none, overlaps=False)


def _tiny_device() -> dict[str, float]:
    return {"flops": measure_flops("tiny"), "bandwidth": measure_bandwidth(size="tiny")}


def _rank_host(calibration: dict[str, Any]) -> dict[str, float]:
    """On 2 ranks: the host work per tensor per stage beyond the one-rank figure and the measured links."""
    from .model import here_cluster

    torch.set_num_threads(1)
    known = {**calibration, "by_size_2_ranks": {"tiny": _tiny_device()}}
    return {str(stage): measure_host_overhead(stage, here_cluster(known, "tiny", 2, stage))
            for stage in range(4)}


def _median_seconds(step: Any, steps: int, warmup: int) -> float:
    """Median wall time of ``step()`` over ``steps`` calls after ``warmup`` (which pay for allocations)."""
    samples = []
    for index in range(warmup + steps):
        start = time.perf_counter()
        step()
        if index >= warmup:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _fit(points: list[tuple[int, float]], n: int, hops: int = 2) -> tuple[float, float]:
    """α, β from all-reduce timings: t = 2(N−1)α + 2(N−1)/N·S·β, fitted by least squares (``hops=1``: an
    all-gather's (N−1)α + (N−1)/N·S·β)."""
    xs, ys = [float(s) for s, _ in points], [t for _, t in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = max(my - slope * mx, 0.0)
    return intercept / (hops * (n - 1)), slope / (hops * (n - 1) / n)


def measure_flops(size: str) -> float:
    """Sustained FLOP/s of forward + backward of the GPT ``size`` on this thread (fp32, one sequence)."""
    from .model import gpt_preset
    from .workload import gpt_module

    gpt = gpt_module()
    torch.manual_seed(0)
    model = gpt.GPT(gpt.gpt_config(size))
    shape = gpt_preset(size)
    x = torch.randint(0, shape.vocab, (1, shape.seq))

    def train_step() -> None:
        _, loss = model(x, x)
        loss.backward()

    return shape.flops_per_token() * shape.seq / _median_seconds(train_step, steps=3, warmup=1)


def measure_bandwidth(numel: int = 8_000_000, size: str = "") -> float:
    """Bytes/s an fp32 AdamW step moves, counting 2 × 16 bytes per parameter (as the model does): over one
    tensor of ``numel``, or over the parameters of the GPT ``size`` (its tensors' sizes set how much of
    each stays in cache between AdamW's passes)."""
    if size:
        from .workload import gpt_module

        gpt = gpt_module()
        params = list(gpt.GPT(gpt.gpt_config(size)).parameters())
    else:
        params = [torch.nn.Parameter(torch.zeros(numel))]
    for param in params:
        param.grad = torch.ones_like(param)
    opt = torch.optim.AdamW(params, lr=1e-3)
    seconds = _median_seconds(opt.step, steps=3, warmup=1)
    return sum(p.numel() for p in params) * 16 * 2 / seconds


def measure_devices() -> dict[str, dict[str, float]]:
    """Per preset: the bare model's FLOP/s and AdamW's bandwidth over its parameters (this thread)."""
    return {size: {"flops": measure_flops(size), "bandwidth": measure_bandwidth(size=size)} for size in _FLOP_SIZES}


def _rank_measure() -> tuple[Any, ...]:
    torch.set_num_threads(1)
    collectives = measure_collectives(_SIZES), measure_shared_memory(_SIZES), measure_shared_memory(_SIZES, gather=True)
    # Both ranks at once, as in a 2-rank run: they share the cores' caches and the memory bus.
    return (*collectives, measure_devices())


def main(argv: list[str] | None = None) -> int:
    from shardwise.testing import run_distributed

    from .model import HERE

    parser = argparse.ArgumentParser(prog="python -m benchmarks.calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="10m", help="GPT preset timed for FLOP/s")
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args(argv)
    points, shared, gathered, together = run_distributed(_rank_measure, world_size=2, timeout=600)[0]
    alpha, beta = _fit(points, 2)
    torch.set_num_threads(1)
    flops, bandwidth = measure_flops(args.size), measure_bandwidth()
    alone = bare_cluster(_tiny_device())
    result: dict[str, Any] = {
        "alpha": alpha, "beta": beta, "flops": flops, "bandwidth": bandwidth,
        "by_size": measure_devices(), "by_size_2_ranks": together,
        "host_per_tensor_by_stage": {str(stage): measure_host_overhead(stage, alone) for stage in range(4)},
        "all_reduce_points": points, "flops_size": args.size,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"), "torch": torch.__version__,
    }
    if shared:
        result["shm_alpha"], result["shm_beta"] = _fit(shared, 2)
        result["shm_gather_alpha"], result["shm_gather_beta"] = _fit(gathered, 2, hops=1)
        result["shm_all_reduce_points"], result["shm_all_gather_points"] = shared, gathered
    # on top of the one-rank host work: what 2 ranks of the tiny preset add beyond the measured links
    result["host_per_tensor_by_stage_2_ranks"] = run_distributed(_rank_host, world_size=2, args=(result,),
                                                                 timeout=600)[0]
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"gloo: alpha {alpha * 1e6:.1f} us, beta {1 / beta / 1e9:.2f} GB/s; shared memory: "
          + (f"alpha {result['shm_alpha'] * 1e6:.1f} us, beta {1 / result['shm_beta'] / 1e9:.2f} GB/s; " if shared
             else "not available; ")
          + f"{flops / 1e9:.1f} GFLOP/s, optimizer bandwidth {bandwidth / 1e9:.2f} GB/s, "
          "host us per tensor, stages 0-3: "
          + " / ".join(f"{v * 1e6:.0f}" for v in result["host_per_tensor_by_stage"].values()) + f" -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
