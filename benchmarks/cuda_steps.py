"""What ``benchmarks.cuda`` measures of each system: timed steps, losses, state, GPU memory; in a group or alone.

A group (:func:`measure_group`) is a shardwise stage with its peers in one
process, all built first; at every step each system takes one step, in an
order that rotates (A B C, B C A, C A B, ...), each bracketed by
``torch.cuda.synchronize()``, so a clock or load change falls on all of them.
There the memory figure is the step's own: the most one step allocated above
what was allocated before it (``torch.cuda.max_memory_allocated``, reset
before each step), since the other systems' state shares the GPU.  Alone
(:func:`measure_alone`, one system in its own process) it is the peak over the
whole run: model, state, gradients, activations.  On the CPU neither is
measurable (None).  Every system's last step is untimed: it also counts the
state it holds (``Harness.state``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch

from .configs import System, Workload
from .systems import Harness, ShardwiseHarness, build_harness
from .workload import batch, gpt_module, synthetic_stream

__all__ = ["Measured", "measure_alone", "measure_group", "workload_of"]

MIB = 2**20


@dataclass
class Measured:
    """One system's figures from a group run or an alone run (see the module docstring)."""

    system: str
    family: str
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    state_mib: Optional[float] = None
    step_peak_mib: Optional[float] = None
    peak_mib: Optional[float] = None
    checkpoint_ok: Optional[bool] = None
    error: Optional[str] = None

    def median_ms(self, warmup: int) -> Optional[float]:
        timed = self.times[warmup:]
        return statistics.median(timed) * 1e3 if timed else None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def workload_of(args: argparse.Namespace) -> Workload:
    return Workload(size=args.size, world_size=1, micro_batch=args.micro_batch, seq_len=args.seq_len,
                    warmup=args.warmup, steps=args.steps, seed=args.seed, lr=args.lr)


def _model(args: argparse.Namespace, overrides: dict[str, int]) -> torch.nn.Module:
    gpt = gpt_module()
    torch.manual_seed(args.seed)
    return gpt.GPT(gpt.gpt_config(args.size, **overrides)).to(args.device)  # type: ignore[no-any-return]


def _on_device(xy: tuple[torch.Tensor, torch.Tensor], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    return xy[0].to(device), xy[1].to(device)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _step(harness: Harness, xy: tuple[torch.Tensor, torch.Tensor], timed: bool, run: Measured, device: str) -> None:
    """One step of ``harness``; its time when ``timed``, else the state it holds; its own memory peak."""
    _sync(device)
    before = 0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    loss = harness.step(xy[0], xy[1], not timed)
    _sync(device)
    elapsed = time.perf_counter() - start
    run.losses.append(float(loss))
    if timed:
        run.times.append(elapsed)
    else:
        run.state_mib = sum(harness.state.values()) / MIB
    if device == "cuda":
        own = (torch.cuda.max_memory_allocated() - before) / MIB
        run.step_peak_mib = max(run.step_peak_mib or 0.0, own)


def _failed(run: Measured, error: BaseException) -> None:
    run.error = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]


def measure_group(args: argparse.Namespace, systems: list[System], overrides: dict[str, int]) -> list[Measured]:
    """Every system of ``systems`` (shardwise first) in this process, steps interleaved; see the module docstring.

    A system that fails to build or step is reported with its error and left out of the later steps.
    """
    workload = workload_of(args)
    stream = synthetic_stream(args.seed)
    runs = [Measured(s.name, s.family) for s in systems]
    harnesses: list[Optional[Harness]] = []
    for system, run in zip(systems, runs):
        try:
            harnesses.append(build_harness(system, _model(args, overrides), workload))
        except Exception as error:  # a peer missing a feature on this device: reported, the others go on
            _failed(run, error)
            harnesses.append(None)
    steps = workload.total_steps + 1  # the last one untimed: it counts the state
    for step in range(steps):
        xy = _on_device(batch(stream, workload, 0, step), args.device)
        live = [i for i, h in enumerate(harnesses) if h is not None]
        shift = step % max(len(live), 1)
        for i in live[shift:] + live[:shift]:
            try:
                _step(harnesses[i], xy, step < steps - 1, runs[i], args.device)  # type: ignore[arg-type]
            except Exception as error:
                _failed(runs[i], error)
                harnesses[i] = None
    first = harnesses[0]
    if isinstance(first, ShardwiseHarness):
        runs[0].checkpoint_ok = _checkpoint_round_trip(first, stream, workload, overrides, args, steps)
    del harnesses
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return runs


def measure_alone(args: argparse.Namespace, system: System, overrides: dict[str, int]) -> Measured:
    """``system`` alone in this process: timed steps and, on CUDA, the peak GPU memory of the whole run."""
    workload = workload_of(args)
    stream = synthetic_stream(args.seed)
    run = Measured(system.name, system.family)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        harness = build_harness(system, _model(args, overrides), workload)
        steps = workload.total_steps + 1
        for step in range(steps):
            xy = _on_device(batch(stream, workload, 0, step), args.device)
            _step(harness, xy, step < steps - 1, run, args.device)
    except Exception as error:
        _failed(run, error)
    if args.device == "cuda":
        run.peak_mib = torch.cuda.max_memory_allocated() / MIB
    run.step_peak_mib = None  # measured per step above; alone, the whole run's peak says more
    return run


def _checkpoint_round_trip(
    harness: ShardwiseHarness, stream: torch.Tensor, workload: Workload, overrides: dict[str, int],
    args: argparse.Namespace, step: int,
) -> bool:
    """Save, load into a fresh engine at the same stage, and compare the next step's loss exactly."""
    engine = harness.engine
    system = System("shardwise", engine.config.zero_optimization.stage, "bf16" if engine.bfloat16_enabled() else "fp32")
    with tempfile.TemporaryDirectory() as tmp:
        engine.save_checkpoint(tmp, tag="t")
        fresh = ShardwiseHarness(_model(args, overrides), system, workload)
        path, _ = fresh.engine.load_checkpoint(tmp, tag="t")
        x, y = (t.to(args.device) for t in batch(stream, workload, 0, step))
        a = float(harness.step(x, y, False))
        b = float(fresh.step(x, y, False))
        del fresh
    return path is not None and a == b
