"""Interleaved launches: every round runs every system once.

Three isolations, all interleaved so that a change in the machine's load (other
jobs on a shared box) falls on every system alike:

* ``pair`` (default): one launch per shardwise stage and precision, holding
  that stage and its peer(s); their timed steps alternate A B, B A, ... inside
  the launch, so a load change hits both within a step.  The group's order
  rotates from round to round, so each system is built first (clean RSS) in
  some round.
* ``process``: fresh ranks for every system in every round; rounds alternate
  the order (A B C, C B A, ...).  Slowest, cleanest memory figures.
* ``round``: one launch per round running every system in turn; the smoke
  test uses it to stay fast.

A system that fails is reported and dropped from later rounds instead of
stopping the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shardwise.testing import run_distributed

from .configs import System, Workload
from .worker import run_group, run_systems

__all__ = ["ISOLATIONS", "Outcome", "groups", "interleaved", "run_rounds"]

ISOLATIONS = ("pair", "process", "round")
Log = Callable[[str], None]


@dataclass
class Outcome:
    """Every round's per-rank measurements of one system, or why it failed."""

    system: System
    workload: Workload
    runs: list[list[dict[str, Any]]] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)  # the round each run came from
    error: str | None = None
    launch_s: list[float] = field(default_factory=list)


def interleaved(systems: list[System], rounds: int) -> list[tuple[int, System]]:
    """``(round, system)`` pairs in run order: forward on even rounds, reversed on odd ones."""
    order: list[tuple[int, System]] = []
    for index in range(rounds):
        sequence = systems if index % 2 == 0 else list(reversed(systems))
        order.extend((index, system) for system in sequence)
    return order


def groups(systems: list[System]) -> list[list[System]]:
    """Each shardwise system followed by the other systems at its stage and precision."""
    result = []
    for mine in (s for s in systems if s.is_shardwise):
        peers = [s for s in systems if not s.is_shardwise and (s.stage, s.dtype) == (mine.stage, mine.dtype)]
        result.append([mine, *peers])
    grouped = {s for group in result for s in group}
    return result + [[s] for s in systems if s not in grouped]


def _rotated(group: list[System], index: int) -> list[System]:
    shift = index % len(group)
    return group[shift:] + group[:shift]


def run_rounds(
    systems: list[System],
    workload: Workload,
    rounds: int,
    *,
    isolation: str = "pair",
    timeout: float = 600.0,
    threads: int = 1,
    log: Log = print,
) -> dict[System, Outcome]:
    """Run every system ``rounds`` times, interleaved; see the module docstring.

    ``timeout`` is in seconds per system and launch.
    """
    if isolation not in ISOLATIONS:
        raise ValueError(f"unknown isolation {isolation!r}; expected one of {ISOLATIONS}")
    outcomes = {system: Outcome(system, workload) for system in systems}
    launcher = _Launcher(outcomes, workload, timeout, threads, log)
    for index in range(rounds):
        if isolation == "round":
            launcher.run(index, run_systems, _forward_or_back(systems, index))
            continue
        units = groups(systems) if isolation == "pair" else [[s] for s in systems]
        for unit in _forward_or_back(units, index):
            launcher.run(index, run_group, _rotated(unit, index))
    return outcomes


def _forward_or_back(items: list[Any], index: int) -> list[Any]:
    return items if index % 2 == 0 else list(reversed(items))


@dataclass
class _Launcher:
    """Launches a list of systems in one set of ranks and files the results."""

    outcomes: dict[System, Outcome]
    workload: Workload
    timeout: float
    threads: int
    log: Log

    def run(self, index: int, fn: Callable[..., Any], systems: list[System]) -> None:
        alive = [s for s in systems if self.outcomes[s].error is None]
        if not alive:
            return
        start = time.perf_counter()
        try:
            ranks = run_distributed(fn, world_size=self.workload.world_size, args=(alive, self.workload),
                                    timeout=self.timeout * len(alive), threads_per_rank=self.threads)
        except Exception as error:  # noqa: BLE001 - any failure is reported, the run goes on
            if len(alive) > 1:  # find out which system it was: run each alone
                for system in alive:
                    self.run(index, fn, [system])
                return
            self._fail(index, alive[0], _first_lines(error))
            return
        share = (time.perf_counter() - start) / len(alive)
        for system, result in zip(alive, ranks[0]):  # every rank returns the same gathered results
            if isinstance(result, str):
                self._fail(index, system, result)
                continue
            outcome = self.outcomes[system]
            outcome.runs.append(result)
            outcome.rounds.append(index)
            outcome.launch_s.append(share)
            self.log(_progress(index, outcome))

    def _fail(self, index: int, system: System, error: str) -> None:
        self.outcomes[system].error = error
        self.log(f"  round {index} {system.name}: FAILED {error.splitlines()[0] if error else ''}")


def _first_lines(error: BaseException, head: int = 300, tail: int = 1500) -> str:
    """The error's start (which rank) and end (the exception raised there)."""
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= head + tail else f"{text[:head]}\n...\n{text[-tail:]}"


def _progress(index: int, outcome: Outcome) -> str:
    ranks = outcome.runs[-1]
    times = sorted(max(step) for step in zip(*(r["times"] for r in ranks)))
    loss = sum(r["losses"][-1] for r in ranks) / len(ranks)
    return (
        f"  round {index} {outcome.system.name:<24} median step {1000 * times[len(times) // 2]:8.1f} ms"
        f"  loss {loss:.4f}  ({outcome.launch_s[-1]:.1f} s)"
    )
