"""What each rank runs: build systems, warm them up, time their steps, account their memory.

Called on every rank by :func:`shardwise.testing.run_distributed`.  A launch
holds one system (``run_system``) or a small group (``run_group``: a shardwise
stage and its peers).  In a group, systems are built and warmed up one after
the other, then their timed steps alternate A B, B A, A B, ... so that a
change in the machine's load hits all of them alike.

Peak RSS is taken per system, from just before it is built to the end of its
warm-up (to the end of the run when it is alone).  Only the first system built
in a process gets a clean figure: later ones may reuse pages the allocator
kept from earlier ones, so their ``rss_clean`` is False.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .configs import System, Workload
from .systems import Harness, build_harness
from .workload import batch, build_model, synthetic_stream

__all__ = ["rss_bytes", "run_group", "run_system", "run_systems"]


def _import_everything() -> None:
    """Import every system's modules so all of them start from the same resident memory."""
    import torch.distributed.fsdp
    import torch.distributed.optim
    import torch.nn.parallel  # noqa: F401

    import shardwise  # noqa: F401

    from . import peers  # noqa: F401


def rss_bytes(field_name: str = "VmRSS") -> int:
    """A ``/proc/self/status`` memory field (``VmRSS`` now, ``VmHWM`` peak) in bytes; 0 if unknown."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_peak_rss() -> None:
    """Make VmHWM restart from the current RSS (Linux ``clear_refs`` 5); best effort."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")
    except OSError:
        pass


@dataclass
class _Run:
    """One system inside this rank: its harness and what was measured."""

    system: System
    harness: Harness
    setup_s: float
    baseline_rss: int
    rss_clean: bool
    peak_rss: int = 0
    losses: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)

    @classmethod
    def build(cls, system: System, workload: Workload, clean: bool) -> _Run:
        """Build ``system`` with its peak RSS counted from here."""
        _reset_peak_rss()
        baseline = rss_bytes()
        start = time.perf_counter()
        harness = build_harness(system, build_model(workload), workload)
        return cls(system, harness, time.perf_counter() - start, baseline, clean)

    def step(self, stream: torch.Tensor, workload: Workload, step: int, timed: bool) -> None:
        x, y = batch(stream, workload, dist.get_rank(), step)
        begin = time.perf_counter()
        loss = self.harness.step(x, y, measure=step == workload.total_steps - 1)
        elapsed = time.perf_counter() - begin
        self.losses.append(float(loss.float()))
        if timed:
            self.times.append(elapsed)

    def report(self) -> dict[str, Any]:
        return {
            "rank": dist.get_rank(),
            "times": self.times,
            "losses": self.losses,
            "setup_s": self.setup_s,
            "baseline_rss": self.baseline_rss,
            "peak_rss": self.peak_rss,
            "rss_clean": self.rss_clean,
            "state": self.harness.state,
            "bytes_sent": self.harness.bytes_sent(),
            # how a shardwise engine's collectives travel (theory counts stages 1-2's reduction by it)
            "transport": getattr(self.harness, "transport", None),
            "threads": torch.get_num_threads(),
        }


def run_group(systems: list[System], workload: Workload) -> list[list[dict[str, Any]]]:
    """Train ``systems`` side by side; for each system, every rank's measurements."""
    _import_everything()
    stream = synthetic_stream(workload.seed)
    runs: list[_Run] = []
    for index, system in enumerate(systems):
        run = _Run.build(system, workload, clean=index == 0)
        runs.append(run)
        for step in range(workload.warmup):
            run.step(stream, workload, step, timed=False)
        run.peak_rss = rss_bytes("VmHWM")
    for run in runs:
        run.harness.reset_counters()
    dist.barrier()  # timed steps start together on every rank
    for i in range(workload.steps):
        for run in runs if i % 2 == 0 else runs[::-1]:
            run.step(stream, workload, workload.warmup + i, timed=True)
    if len(runs) == 1:
        runs[0].peak_rss = rss_bytes("VmHWM")  # alone: its peak covers the timed steps too
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [run.report() for run in runs])
    return [[ranks[k] for ranks in everyone] for k in range(len(runs))]


def run_system(system: System, workload: Workload) -> list[dict[str, Any]]:
    """Train one system alone; every rank's measurements."""
    return run_group([system], workload)[0]


def run_systems(systems: list[System], workload: Workload) -> list[Any]:
    """:func:`run_system` for each system in turn, in these same processes.

    Cheaper than fresh processes per system (imports and warm-up are paid
    once), at the price of RSS figures that include whatever the allocator kept
    from earlier systems.  A system that raises on every rank (e.g. a stage
    this checkout lacks) gives its error text instead of results.
    """
    results: list[Any] = []
    for index, system in enumerate(systems):
        try:
            ranks = run_system(system, workload)
            for rank in ranks:
                rank["rss_clean"] = index == 0
            results.append(ranks)
        except Exception as error:  # noqa: BLE001 - reported per system by the launcher
            results.append(f"{type(error).__name__}: {error}")
        gc.collect()
    return results
