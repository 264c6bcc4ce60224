"""``python -m benchmarks.calibrate``: measure this machine for the cost model (:mod:`benchmarks.model`).

* α, β of gloo on loopback: all-reduce of 16 KiB to 64 MiB on 2 ranks (1 torch
  thread each, as the benchmark runs), median of 15 per size; a line
  t = a + b·S fitted to the relative errors gives α = a / (2(N−1)) and
  β = b / (2(N−1)/N).
* The same through shardwise's shared memory (what its engine uses on one
  host, ``shardwise.comm.shm``): ``Comm.all_reduce`` of a region of a buffer every
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
* Host work per parameter tensor and per gradient byte, per stage: one rank
  trains the ``tiny`` GPT (a preset the validation does not use) through an
  engine at that stage, and tiny made 4× wider (the same tensors, 14× the
  bytes); what each step time has beyond the model's terms (with each shape's
  own device figures; median of 60 steps) splits into a part per tensor and a
  part per byte.
  And the same with 2 ranks beyond everything the model predicts for them with
  the links measured above (the ranks waiting for each other at every
  collective and contending for the cores and the memory bus, on top; each
  step timed by its slowest rank, as the benchmark times it; the median of
  three passes, as it swings with load): per tensor and per gradient byte at
  stages 0-2 (tiny and the wider tiny again), per gathered unit at stage 3,
  where the ranks meet at every unit's gathers and reduce-scatter.

Each figure is the median over ``--repeat`` passes (3 by default): on a shared
machine one pass can catch a burst of load.  Writes
``benchmarks/calibration.json`` (``--out`` to write elsewhere).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["calibrate", "main", "measure_collectives", "median_of"]

_SIZES = [1 << k for k in range(14, 27, 2)]  # 16 KiB .. 64 MiB
#: the presets whose compute rate is measured on its own (matrix size sets a CPU's FLOP rate)
_FLOP_SIZES = ("small", "10m", "40m")
#: passes over the stages when measuring what 2 ranks add to the host work (see :func:`_rank_host`)
_HOST_PASSES = 3
#: at least this much timed work per FLOP-rate or bandwidth figure (small shapes take milliseconds a step)
_MIN_SECONDS = 1.0
#: the tiny preset made 4× wider: the same 26 parameter tensors with 14× the gradient bytes, so that the host
#: work a stage adds splits into a part per tensor and a part per byte (neither shape is validated)
_WIDE = {"n_embd": 256, "n_head": 4}


def measure_collectives(sizes: list[int], repeats: int = 15) -> list[tuple[int, float]]:
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


def measure_shared_memory(sizes: list[int], repeats: int = 15, gather: bool = False) -> list[tuple[int, float]]:
    """On every rank: (bytes, median seconds) of an fp32 all-reduce through shared memory of a region of a
    shared buffer, or (``gather``) an all-gather of a private tensor into ``bytes`` (collective)."""
    import torch.distributed as dist

    from shardwise.comm.distributed import Comm

    comm = Comm(None)
    comm.open_shared_memory()
    if not comm.shm.active:
        return []
    buffer = comm.shm.zeros(max(sizes) // 4, torch.float32, torch.device("cpu"))
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


def measure_host_overhead(stage: int, cluster: Any, size: str = "tiny", **overrides: int) -> float:
    """Seconds per step beyond what ``cluster`` predicts for ``size`` (with ``overrides`` of its config) at
    ``stage`` (every rank of the current group trains; a collective with 2 ranks).

    With one rank and :func:`bare_cluster` of the ``size`` model's own FLOP rate and AdamW bandwidth, what
    remains is the engine's host work (hooks, unit bookkeeping at stage 3, the optimizer's loop).  With 2
    ranks and a cluster of the measured links, what remains is also the ranks waiting for each other."""
    import torch.distributed as dist

    import shardwise

    from .model import Job, gpt_preset, step_time
    from .workload import gpt_module

    gpt = gpt_module()
    torch.manual_seed(0)
    model = gpt.GPT(gpt.gpt_config(size, **overrides))
    # every tensor its own gathered unit at stage 3 (tiny's are all below the default persistence threshold,
    # which would leave the unit machinery out of the figure)
    zero: dict[str, Any] = {"stage": stage} | ({"stage3_param_persistence_threshold": 0} if stage == 3 else {})
    engine = shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"zero_optimization": zero})
    shape = gpt_preset(size, **overrides)
    x = torch.randint(0, shape.vocab, (1, shape.seq))

    def train_step() -> None:
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()

    n = dist.get_world_size() if dist.is_initialized() else 1
    measured = _median_seconds(train_step, steps=60, warmup=5, slowest_rank=n > 1)
    engine.destroy()
    job = Job(shape, param_bytes=4, grad_bytes=4, state_bytes=8, checkpointing=False)
    modelled = step_time(job, stage, n, cluster)["total"]
    return max(measured - modelled, 0.0)


def _shapes() -> tuple[Any, Any]:
    """The tiny preset and the tiny preset made wider (:data:`_WIDE`), as :class:`Transformer` shapes."""
    from .model import gpt_preset

    return gpt_preset("tiny"), gpt_preset("tiny", **_WIDE)


def _extra_of_shapes(stage: int, narrow: Any, wide: Any) -> tuple[float, float]:
    """Seconds per step beyond the model of tiny (against cluster ``narrow``) and of :data:`_WIDE` tiny
    (against ``wide``) at ``stage``."""
    return measure_host_overhead(stage, narrow), measure_host_overhead(stage, wide, "tiny", **_WIDE)


def host_terms(stage: int, narrow: Any, wide: Any) -> tuple[float, float]:
    """One rank at ``stage``: (seconds per parameter tensor, seconds per gradient byte) of host work, from
    the tiny preset and the tiny preset made wider (:data:`_WIDE`: the same tensors, more bytes), each
    against :func:`bare_cluster` of its own measured device figures (``narrow``, ``wide``)."""
    return split_host(_extra_of_shapes(stage, narrow, wide), _shapes())


def split_host(extra: tuple[float, float], shapes: tuple[Any, Any]) -> tuple[float, float]:
    """(seconds per tensor, seconds per fp32 gradient byte) from the extra seconds per step of two shapes with
    the same tensors and different sizes: the difference is all bytes; what remains of the first, tensors."""
    (narrow, wide), (small, large) = extra, shapes
    per_byte = max(wide - narrow, 0.0) / (4 * (large.numel - small.numel))
    return max(narrow - per_byte * 4 * small.numel, 0.0) / small.tensors, per_byte


def bare_cluster(device: dict[str, float]) -> Any:
    """One rank with ``device``'s FLOP rate and bandwidth, and no links."""
    from .collectives import Link
    from .model import GB, Cluster, Device

    bare = Device("bare", device["flops"], 24 * GB, device["bandwidth"], "calibration")
    none = Link("none", 0.0, 0.0, "calibration")
    return Cluster("one rank", bare, 1, none, none, overlaps=False)


def _device(size: str, **overrides: int) -> dict[str, float]:
    """The bare GPT ``size``'s FLOP rate and AdamW bandwidth on this thread."""
    return {"flops": measure_flops(size, **overrides), "bandwidth": measure_bandwidth(size=size, **overrides)}


def _rank_host(calibration: dict[str, Any]) -> tuple[dict[str, tuple[float, float]], float]:
    """On 2 ranks: beyond the one-rank figures and the measured links, the host work per tensor and per
    gradient byte at stages 0-2 (from tiny and :data:`_WIDE` tiny, as :func:`host_terms` splits them), and
    per gathered unit at stage 3 (whose ranks meet at every unit's collectives)."""
    from .model import here_cluster
    from .workload import model_units

    torch.set_num_threads(1)
    wide = "tiny (wide)"
    known = {**calibration, "by_size_2_ranks": {"tiny": _device("tiny"), wide: _device("tiny", **_WIDE)}}

    def one_pass() -> tuple[list[tuple[float, float]], float]:
        flat = [_extra_of_shapes(stage, here_cluster(known, "tiny", 2, stage), here_cluster(known, wide, 2, stage))
                for stage in range(3)]
        return flat, measure_host_overhead(3, here_cluster(known, "tiny", 2, 3))

    # What 2 ranks add is mostly the ranks waiting for each other and contending for the cores and the
    # memory bus (which grows with the bytes each step moves); it swings with the machine's load more than
    # anything else measured here: the median of three passes over the stages, taken in turn.
    passes = [one_pass() for _ in range(_HOST_PASSES)]
    per_stage = {str(stage): split_host(_median_pair([flat[stage] for flat, _ in passes]), _shapes())
                 for stage in range(3)}
    return per_stage, statistics.median(stage3 for _, stage3 in passes) / model_units("tiny", threshold=0)


def _median_pair(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs)


def _median_seconds(step: Any, steps: int, warmup: int, slowest_rank: bool = False,
                    min_seconds: float = 0.0) -> float:
    """Median wall time of ``step()`` over ``steps`` calls after ``warmup`` (which pay for allocations), and
    more calls until the timed ones add up to ``min_seconds`` (a short step is timed many times).

    ``slowest_rank`` (collective): each call's time is the longest any rank took, as the benchmark counts
    a step (one rank's wait at a collective is the other's lead, so either rank alone reads short); the
    ranks then must make the same number of calls, so ``min_seconds`` must be 0."""
    samples: list[float] = []
    for index in itertools.count():
        if index >= warmup + steps and sum(samples) >= min_seconds:
            break
        start = time.perf_counter()
        step()
        if index >= warmup:
            samples.append(time.perf_counter() - start)
    if slowest_rank:
        import torch.distributed as dist

        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, samples)
        samples = [max(times) for times in zip(*everyone)]
    return statistics.median(samples)


def _fit(points: list[tuple[int, float]], n: int, hops: int = 2) -> tuple[float, float]:
    """α, β from all-reduce timings: t = 2(N−1)α + 2(N−1)/N·S·β, fitted by least squares of the relative
    error (``hops=1``: an all-gather's (N−1)α + (N−1)/N·S·β).

    The sizes span four decades: an ordinary least-squares line is set by the largest sizes alone, and its
    intercept (α) swung 2-4× between calibrations; weighting each point by 1/t² makes every size count."""
    xs, ys = [float(s) for s, _ in points], [t for _, t in points]
    weights = [1 / y**2 for y in ys]
    mx = sum(w * x for w, x in zip(weights, xs)) / sum(weights)
    my = sum(w * y for w, y in zip(weights, ys)) / sum(weights)
    slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(weights, xs, ys)) / \
        sum(w * (x - mx) ** 2 for w, x in zip(weights, xs))
    intercept = max(my - slope * mx, 0.0)
    return intercept / (hops * (n - 1)), slope / (hops * (n - 1) / n)


def measure_flops(size: str, **overrides: int) -> float:
    """Sustained FLOP/s of forward + backward of the GPT ``size`` (with ``overrides`` of its config) on this
    thread (fp32, one sequence)."""
    from .model import gpt_preset
    from .workload import gpt_module

    gpt = gpt_module()
    torch.manual_seed(0)
    model = gpt.GPT(gpt.gpt_config(size, **overrides))
    shape = gpt_preset(size, **overrides)
    x = torch.randint(0, shape.vocab, (1, shape.seq))

    def train_step() -> None:
        _, loss = model(x, x)
        loss.backward()

    seconds = _median_seconds(train_step, steps=5, warmup=2, min_seconds=_MIN_SECONDS)
    return shape.flops_per_token() * shape.seq / seconds


def measure_bandwidth(numel: int = 8_000_000, size: str = "", **overrides: int) -> float:
    """Bytes/s an fp32 AdamW step moves, counting 2 × 16 bytes per parameter (as the model does): over one
    tensor of ``numel``, or over the parameters of the GPT ``size`` (its tensors' sizes set how much of
    each stays in cache between AdamW's passes)."""
    if size:
        from .workload import gpt_module

        gpt = gpt_module()
        params = list(gpt.GPT(gpt.gpt_config(size, **overrides)).parameters())
    else:
        params = [torch.nn.Parameter(torch.zeros(numel))]
    for param in params:
        param.grad = torch.ones_like(param)
    opt = torch.optim.AdamW(params, lr=1e-3)
    seconds = _median_seconds(opt.step, steps=5, warmup=2, min_seconds=_MIN_SECONDS)
    return sum(p.numel() for p in params) * 16 * 2 / seconds


def measure_devices() -> dict[str, dict[str, float]]:
    """Per preset: the bare model's FLOP/s and AdamW's bandwidth over its parameters (this thread)."""
    return {size: {"flops": measure_flops(size), "bandwidth": measure_bandwidth(size=size)} for size in _FLOP_SIZES}


def _rank_measure() -> tuple[Any, ...]:
    torch.set_num_threads(1)
    collectives = measure_collectives(_SIZES), measure_shared_memory(_SIZES), measure_shared_memory(_SIZES, gather=True)
    # Both ranks at once, as in a 2-rank run: they share the cores' caches and the memory bus.
    return (*collectives, measure_devices())


def calibrate(size: str) -> dict[str, Any]:
    """One pass over every measurement of the module docstring (``size``: the preset timed for FLOP/s)."""
    from shardwise.testing import run_distributed

    points, shared, gathered, together = run_distributed(_rank_measure, world_size=2, timeout=600)[0]
    alpha, beta = _fit(points, 2)
    torch.set_num_threads(1)
    narrow, wide = bare_cluster(_device("tiny")), bare_cluster(_device("tiny", **_WIDE))
    host = {str(stage): host_terms(stage, narrow, wide) for stage in range(4)}
    result: dict[str, Any] = {
        "alpha": alpha, "beta": beta, "flops": measure_flops(size), "bandwidth": measure_bandwidth(),
        "by_size": measure_devices(), "by_size_2_ranks": together, **_host_keys(host, ""),
        "all_reduce_points": points, "flops_size": size,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"), "torch": torch.__version__,
    }
    if shared:
        result["shm_alpha"], result["shm_beta"] = _fit(shared, 2)
        result["shm_gather_alpha"], result["shm_gather_beta"] = _fit(gathered, 2, hops=1)
        result["shm_all_reduce_points"], result["shm_all_gather_points"] = shared, gathered
    # on top of the one-rank host work: what 2 ranks of the tiny preset add beyond the measured links
    per_stage, per_unit = run_distributed(_rank_host, world_size=2, args=(result,), timeout=900)[0]
    return result | _host_keys(per_stage, "_2_ranks") | {"host_per_unit_2_ranks": per_unit}


def _host_keys(terms: dict[str, tuple[float, float]], suffix: str) -> dict[str, dict[str, float]]:
    """calibration.json's keys for (per tensor, per byte) host terms by stage."""
    return {f"host_per_tensor_by_stage{suffix}": {stage: t[0] for stage, t in terms.items()},
            f"host_per_byte_by_stage{suffix}": {stage: t[1] for stage, t in terms.items()}}


def median_of(passes: list[Any]) -> Any:
    """Figure by figure, the median over calibration passes (nested dicts; (bytes, seconds) point lists by
    size; text from the first pass)."""
    first = passes[0]
    if isinstance(first, dict):
        return {key: median_of([p[key] for p in passes]) for key in first if all(key in p for p in passes)}
    if isinstance(first, list):
        return [[point[0], statistics.median(p[i][1] for p in passes)] for i, point in enumerate(first)]
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return statistics.median(passes)
    return first


def main(argv: list[str] | None = None) -> int:
    from .model import HERE

    parser = argparse.ArgumentParser(prog="python -m benchmarks.calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="10m", help="GPT preset timed for FLOP/s")
    parser.add_argument("--repeat", type=int, default=3,
                        help="passes; each figure is the median over them (one pass can catch a burst of load)")
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args(argv)
    result = median_of([calibrate(args.size) for _ in range(args.repeat)]) | {"passes": args.repeat}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    shared = "shm_alpha" in result
    print(f"gloo: alpha {result['alpha'] * 1e6:.1f} us, beta {1 / result['beta'] / 1e9:.2f} GB/s; shared memory: "
          + (f"alpha {result['shm_alpha'] * 1e6:.1f} us, beta {1 / result['shm_beta'] / 1e9:.2f} GB/s; " if shared
             else "not available; ")
          + f"{result['flops'] / 1e9:.1f} GFLOP/s, optimizer bandwidth {result['bandwidth'] / 1e9:.2f} GB/s, "
          "host us per tensor, stages 0-3: "
          + " / ".join(f"{v * 1e6:.0f}" for v in result["host_per_tensor_by_stage"].values())
          + "; host ns per gradient byte: "
          + " / ".join(f"{v * 1e9:.2f}" for v in result["host_per_byte_by_stage"].values()) + f" -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
