"""Checking that the ranks issued the same collectives, over a group of its own.

Each process group gets, on first use, a small *control* group: a gloo
backend built directly on a prefix of the c10d store, with ``comms.timeout``
as its own timeout, outside torch's group registry (so creating it is not a
collective of the world, and its messages can never pair with a data
collective).  Every message on it is the same 16 int64s (8 values and their
negatives, reduced with MAX: one all-reduce gives every rank the maximum and
the minimum of each value), so two checks can never disagree about size.

* :func:`agree` (the step check, always on): once per optimizer step the
  engine compares the group's collective count and fingerprint and its own
  counters.  Ranks whose collectives paired up silently but wrongly (same
  sizes, different units) are caught before the step applies their gradients.
* :func:`before` (``comms.debug``): before every collective, its kind, size,
  dtype and label; a mismatch raises on every rank before any data moves.

When values differ, every rank sees it (they all hold the same maxima and
minima) and each publishes its recent collectives in the store; the error
shows the first place they differ.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from .diagnose import AGREE, Failure, diagnose, short_cause
from .errors import CollectiveMismatchError
from .heartbeat import heartbeat, read_json
from .ledger import Ledger, current_activity

__all__ = ["CHECK", "DEBUG", "agree", "before"]

_WIDTH = 8
CHECK = 1
DEBUG = 2
#: values compared but not worth showing (hashes, the message kind: the description says it)
_HIDDEN = {"kind", "fingerprint", "collective", "collective number"}


class _Control:
    """The control group of one process group."""

    def __init__(self, ledger: Ledger, rank: int, timeout: float) -> None:
        store = dist.distributed_c10d._get_default_store()
        prefix = dist.PrefixStore(f"shardwise/control/{ledger.key}", store)
        # typed as Any: torch's stubs give ProcessGroupGloo no `allreduce`, which its bindings have
        self.group: Any = dist.ProcessGroupGloo(prefix, ledger.ranks.index(rank), len(ledger.ranks),
                                                timedelta(seconds=timeout))
        self.store = store
        self.timeout = timeout
        self.count = 0
        self.options = dist.AllreduceOptions()
        self.options.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
        self.options.timeout = timedelta(seconds=timeout)
        self.buffer = torch.zeros(2 * _WIDTH, dtype=torch.int64)

    def exchange(self, values: Sequence[int]) -> tuple[list[int], list[int]]:
        """Every rank's ``values``: returns (maxima, minima)."""
        self.count += 1
        row = list(values) + [0] * (_WIDTH - len(values))
        self.buffer.copy_(torch.tensor(row + [-v for v in row], dtype=torch.int64))
        self.group.allreduce([self.buffer], self.options).wait()
        reduced = self.buffer.tolist()
        return reduced[:_WIDTH], [-v for v in reduced[_WIDTH:]]


def _control(ledger: Ledger, rank: int, timeout: float, what: str) -> _Control:
    if ledger.control is None:
        try:
            ledger.control = _Control(ledger, rank, timeout)
        except RuntimeError as exc:
            raise _failed(ledger, rank, timeout, f"{what} (setting up its group)", exc) from exc
    control: _Control = ledger.control
    return control


def _failed(ledger: Ledger, rank: int, timeout: float, what: str, exc: BaseException) -> BaseException:
    error = diagnose(Failure(ledger, rank, what, short_cause(exc), timeout))
    ledger.broken = error
    return error


def agree(ledger: Ledger, rank: int, timeout: float, point: str, counters: Sequence[int], names: Sequence[str]) -> None:
    """The step check: the group's collectives so far, and ``counters`` (named by ``names``), on every rank."""
    what = f"in the step check at {point} (after collective #{ledger.seq})"
    values = [CHECK, ledger.seq, ledger.fingerprint, *counters]
    _compare(ledger, rank, timeout, what, values, ["kind", "collectives", "fingerprint", *names])


def before(ledger: Ledger, rank: int, timeout: float, key: int, description: str) -> None:
    """``comms.debug``: the collective about to be issued (number ``ledger.seq``) is the same on every rank."""
    what = f"in the collective check (`comms.debug`) before {description}"
    _compare(ledger, rank, timeout, what, [DEBUG, ledger.seq, key], ["kind", "collective number", "collective"])


def _compare(ledger: Ledger, rank: int, timeout: float, what: str, values: list[int], names: list[str]) -> None:
    if ledger.broken is not None:
        raise ledger.broken
    control = _control(ledger, rank, timeout, what)
    try:
        maxima, minima = control.exchange(values)
    except RuntimeError as exc:
        raise _failed(ledger, rank, timeout, what, exc) from exc
    if maxima != minima:
        error = _mismatch(ledger, rank, control, what, values, names)
        ledger.broken = error
        raise error


# ------------------------------------------------------------------ reports
def _mismatch(ledger: Ledger, rank: int, control: _Control, what: str, values: list[int],
              names: list[str]) -> CollectiveMismatchError:
    """Every rank saw the mismatch: share what each did since the last check, and say where they part."""
    mine = {"what": what, "doing": current_activity(), "values": values,
            "recent": [(e.seq, e.describe()) for e in list(ledger.log)[-16:]]}
    prefix = f"shardwise/faults/mismatch/{ledger.key}/{control.count}"
    control.store.set(f"{prefix}/{rank}", json.dumps(mine))
    reports = _collect(control.store, prefix, ledger.ranks, control.timeout)
    reports[rank] = mine
    return CollectiveMismatchError(_message(ledger, rank, reports, names), rank=rank,
                                   where={r: str(rep.get("what")) for r, rep in reports.items()})


def _report_problem(report: dict[str, Any]) -> Optional[str]:
    values = report.get("values")
    if isinstance(report.get("what"), str) and isinstance(values, list) and all(isinstance(v, int) for v in values):
        return None
    return "a mismatch report has a text `what` and a list of integer `values`"


def _collect(store: Any, prefix: str, ranks: list[int], timeout: float) -> dict[int, dict[str, Any]]:
    deadline = time.monotonic() + min(timeout, 10.0)
    reports: dict[int, dict[str, Any]] = {}
    while len(reports) < len(ranks) and time.monotonic() < deadline:
        for r in ranks:
            key = f"{prefix}/{r}"
            report = None if r in reports else read_json(store, key, _report_problem)
            if report is not None:
                reports[r] = report
        if len(reports) < len(ranks):
            beat = heartbeat()
            time.sleep(beat.interval / 4 if beat is not None else 0.01)
    return reports


def _message(ledger: Ledger, rank: int, reports: dict[int, dict[str, Any]], names: list[str]) -> str:
    lines = []
    for r in ledger.ranks:
        report = reports.get(r)
        if report is None:
            lines.append(f"  rank {r}: sent no report (it may be gone)")
            continue
        shown = ", ".join(f"{n}={v}" for n, v in zip(names, report["values"]) if n not in _HIDDEN)
        lines.append(f"  rank {r}: {report['what']}" + (f"; {shown}" if shown else ""))
    differ = _differing_values(ledger.ranks, reports, names)
    first = _first_difference(ledger.ranks, reports)
    return (f"rank {rank}: the ranks of process group {ledger.key} disagree ({differ}); {AGREE}\n"
            f"What each rank did:\n" + "\n".join(lines) + (f"\n{first}" if first else ""))


def _differing_values(ranks: list[int], reports: dict[int, dict[str, Any]], names: list[str]) -> str:
    """Which compared values differ, e.g. ``backwards accumulated: rank 0 2, rank 1 3``."""
    parts = []
    for index, name in enumerate(names):
        values = {r: rep["values"][index] for r, rep in reports.items() if index < len(rep.get("values", []))}
        if len(set(values.values())) > 1:
            if name in _HIDDEN:
                parts.append("the collectives issued" if name != "kind" else "which check they are in")
            else:
                parts.append(f"{name}: " + ", ".join(f"rank {r} {v}" for r, v in sorted(values.items())))
    return "; ".join(dict.fromkeys(parts)) or "their reports did not arrive"


def _first_difference(ranks: list[int], reports: dict[int, dict[str, Any]]) -> Optional[str]:
    """The first collective number at which the ranks' recent logs differ."""
    logs = {r: dict(map(tuple, rep.get("recent", []))) for r, rep in reports.items()}
    if len(logs) < 2:
        return None
    numbers = sorted(set().union(*[set(log) for log in logs.values()]))
    for seq in numbers:
        seen = {r: log.get(seq) for r, log in logs.items()}
        if len({str(v) for v in seen.values()}) > 1:
            listed = "\n".join(f"  rank {r}: {v if v is not None else 'nothing (fewer collectives)'}"
                               for r, v in sorted(seen.items()))
            return f"The first collective that differs is number {seq}:\n{listed}"
    return None
