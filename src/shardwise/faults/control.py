"""Checking that the ranks issued the same collectives, over a group of its own.

Each process group gets, on first use, a small gloo *control* group built on a prefix of the c10d store
(outside torch's group registry: making it is no collective of the world, and its messages never pair with a
data collective).  Every exchange is the same 16 int64s, 8 values and their negatives reduced with MAX, so one
all-reduce gives every rank each value's maximum and minimum; the last value is how many engine calls of the
process failed after they started (:attr:`~.ledger.doing.failures`: ranks that differ there failed apart).
The kinds: the step check (:data:`CHECK`), ``comms.debug``'s check (:data:`DEBUG`) and an announcement
(:data:`ANNOUNCE`).  The exchange itself is :meth:`shardwise.comm.distributed.Comm.agree` (it is on every gradient's
path); this module sets the group up (:func:`open_group`), says how values differ or the exchange failed, and marks
an exchange still waiting after 50 ms in the store (:func:`waiting_in_next`) so that none is ever abandoned.
docs/faults.md ("How it works") tells why and the rest.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from .diagnose import AGREE, Failure, diagnose, short_cause
from .errors import CollectiveMismatchError
from .heartbeat import heartbeat, read_json
from .heartbeat import published as published_error
from .ledger import Ledger, current_activity
from .liveness import PeerWatch
from .published import SLICE_S

__all__ = ["ANNOUNCE", "ANNOUNCED", "CALLS", "CHECK", "DEBUG", "FAILURES", "SAY_AFTER_S", "WIDTH", "ControlGroup",
           "disagreement", "failed", "open_group", "say_waiting", "waiting_in_next"]

#: values per exchange (the last one the failure count)
WIDTH = 8
#: an exchange still waiting after this many seconds says so in the store (:func:`waiting_in_next`): one store
#: `set` against a wait already 50 ms long
SAY_AFTER_S = 0.05
#: the kinds of exchange (the first value of each)
CHECK = 1
DEBUG = 2
ANNOUNCE = 3
#: what every exchange compares last: how many engine calls of the process failed after they started
FAILURES = "failed engine calls"
#: what an announcement's values are
ANNOUNCED = ["kind", "operation", "engine", "global_steps", "micro_steps"]
#: values compared but not worth showing (hashes, the message kind: the description says it)
_HIDDEN = {"kind", "fingerprint", "collective", "collective number", "operation", "engine", ""}
CALLS = ("every rank must make the same collective calls in the same order: `save_checkpoint`, `load_checkpoint`, "
         "`full_state_dict`, `save_16bit_model`, `save_pretrained`, `destroy`, `GatheredParameters`, `generate` "
         "and every forward and backward of a ZeRO-3 model run on every rank together (rank 0 alone writes the "
         "files); call them on every rank, not under `if rank == 0:`")
FAILED_APART = ("The ranks failed apart: their collectives since may have paired silently wrong, so this process "
                "group cannot be used again; let the job exit and restart it from the last checkpoint "
                "(`shardwise run --max-restarts N`). An error raised, and caught, on every rank together is fine: "
                "call `engine.zero_grad()` on every rank and go on")


class ControlGroup:
    """The control group of one process group: its gloo backend and the buffer every exchange reduces in place
    (with MAX: the first :data:`WIDTH` values are the maxima, the rest the negated minima)."""

    def __init__(self, ledger: Ledger, rank: int, timeout: float) -> None:
        self.store, self.timeout = dist.distributed_c10d._get_default_store(), timeout
        self.group = _connect(dist.PrefixStore(f"shardwise/control/{ledger.key}", self.store), ledger, rank, timeout)
        #: exchanges issued on the group so far (what :func:`waiting_in_next` compares)
        self.count = 0
        self.options = dist.AllreduceOptions()
        self.options.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
        self.options.timeout = timedelta(seconds=timeout)
        self.buffer = torch.zeros(2 * WIDTH, dtype=torch.int64)


def _connect(prefix: Any, ledger: Ledger, rank: int, timeout: float) -> Any:
    """The control group's gloo backend.  Building it waits for every rank to build its end (up to
    ``timeout``): done on a helper thread (it releases the GIL) while this one watches the peers, so a peer that
    died or raised before building its end is named within seconds."""
    made: dict[str, Any] = {}

    def build() -> None:
        try:
            # typed as Any: torch's stubs give ProcessGroupGloo no `allreduce`, which its bindings have
            made["group"] = dist.ProcessGroupGloo(prefix, ledger.ranks.index(rank), len(ledger.ranks),
                                                  timedelta(seconds=timeout))
        except BaseException as exc:  # noqa: BLE001 - raised on the calling thread below
            made["error"] = exc

    builder = threading.Thread(target=build, name="shardwise-control-setup", daemon=True)
    builder.start()
    watch, peers = PeerWatch(), [r for r in ledger.ranks if r != rank]
    while builder.is_alive():
        builder.join(SLICE_S)
        found, gone = watch.failed(peers), watch.gone(peers)
        if found is not None or gone:
            why = found[1] if found is not None else f"rank(s) {gone} stopped beating (gone)"
            raise RuntimeError(f"{why}, while this rank set up the control group")
    if "error" in made:
        raise made["error"]
    return made["group"]


def open_group(ledger: Ledger, rank: int, timeout: float, what: str) -> ControlGroup:
    """The control group of ``ledger``'s process group, set up on first use (every rank waits for the others
    there: this is exchange 1, as a checkpoint's agreement reads it)."""
    if ledger.control is None:
        say_waiting(dist.distributed_c10d._get_default_store(), ledger, rank, 1)
        try:
            ledger.control = ControlGroup(ledger, rank, timeout)
        except RuntimeError as exc:
            raise failed(ledger, rank, timeout, f"{what} (setting up its group)", exc) from exc
    control: ControlGroup = ledger.control
    return control


def failed(ledger: Ledger, rank: int, timeout: float, what: str, exc: BaseException) -> BaseException:
    """The error for an exchange (or its set-up) that failed; the group is broken from now on."""
    error = diagnose(Failure(ledger, rank, what, short_cause(exc), timeout))
    ledger.broken = error
    return error


def disagreement(ledger: Ledger, rank: int, control: ControlGroup, what: str, row: list[int], names: list[str],
                 maxima: list[int], minima: list[int]) -> CollectiveMismatchError:
    """The ranks exchanged different ``row`` s (named by ``names``; every rank sees the same maxima and minima):
    the error naming what each rank did.  A rank announcing while the others announce or check a step: each
    finished what it issued, nothing of the new operations moved, and the group stays usable.  Collectives that may
    have paired wrongly (step checks that differ, ``comms.debug`` inside an operation), or a failure on some ranks
    only, break it."""
    error = _mismatch(ledger, rank, control, what, row, names)
    if maxima[0] != ANNOUNCE or minima[0] == DEBUG or maxima[-1] != minima[-1]:
        ledger.broken = error
    return error


# ------------------------------------------------------------ who waits in an exchange
def _waiting_key(ledger: Ledger, rank: int) -> str:
    return f"shardwise/announce/{ledger.key}/waiting/{rank}"


def say_waiting(store: Any, ledger: Ledger, rank: int, count: int) -> None:
    """Record that this rank waits in exchange number ``count`` of ``ledger``'s control group (only an exchange
    still waiting after :data:`SAY_AFTER_S` writes it: one store ``set``, off the hot path)."""
    store.set(_waiting_key(ledger, rank), json.dumps({"exchange": count}))


def _exchange_problem(record: dict[str, Any]) -> Optional[str]:
    count = record.get("exchange")
    return None if isinstance(count, int) and not isinstance(count, bool) else "a record with an integer `exchange`"


def waiting_in_next(ledger: Ledger, rank: int, peers: Sequence[int]) -> bool:
    """Whether every one of ``peers`` (global ranks) waits in the control exchange this rank would issue next.

    Such a peer is in another collective operation (or a step check) and waits for this rank: this rank can
    issue its own announcement, which completes at once (a peer whose exchange ended has a lower number)."""
    store = dist.distributed_c10d._get_default_store()
    following = (ledger.control.count if ledger.control is not None else 0) + 1
    for peer in peers:
        record = read_json(store, _waiting_key(ledger, peer), _exchange_problem)
        if record is None or record["exchange"] != following:
            return False
    return bool(peers)


# ------------------------------------------------------------------ reports
def _mismatch(ledger: Ledger, rank: int, control: ControlGroup, what: str, values: list[int],
              names: list[str]) -> CollectiveMismatchError:
    """Every rank saw the mismatch: share what each did since the last check, and say where they part."""
    mine = {"what": what, "doing": current_activity(), "values": values, "error": published_error(),
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
    if any(_kind(report) == ANNOUNCE for report in reports.values()):
        return _calls_message(ledger, rank, reports, names)
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


# ----------------------------------------------------------- announcements
def _kind(report: dict[str, Any]) -> Any:
    values = report.get("values")
    return values[0] if isinstance(values, list) and values else None


def _calls_message(ledger: Ledger, rank: int, reports: dict[int, dict[str, Any]], names: list[str]) -> str:
    """``rank 0: the ranks are in different collective calls: rank 0 is in `full_state_dict` of ..., rank 1 is in
    a stage-3 forward of ...``, then the fix (and, when they failed apart, which rank failed and how)."""
    where = "; ".join(f"rank {r} is {reports[r].get('what')}" if r in reports else
                      f"rank {r} sent no report (it may be gone)" for r in ledger.ranks)
    failures = {r: rep["values"][-1] for r, rep in reports.items() if isinstance(rep.get("values"), list)}
    if len(set(failures.values())) > 1:
        most = max(failures.values())
        failed = ", ".join(f"rank {r}: `{reports[r].get('error') or 'an error'}`"
                           for r, count in sorted(failures.items()) if count == most)
        counts = ", ".join(f"rank {r} {count}" for r, count in sorted(failures.items()))
        return (f"rank {rank}: an engine call failed on some ranks of process group {ledger.key} only ({failed}; "
                f"failed engine calls: {counts}), and they went on: {where}. {FAILED_APART}")
    same_kind = len({_kind(report) for report in reports.values()}) == 1
    differ = _differing_values(ledger.ranks, reports, names) if same_kind else ""
    shown = "; ".join(part for part in differ.split("; ") if part and part != "the collectives issued"
                      and "their reports" not in part)
    shown = f" ({shown})" if shown else ""
    return (f"rank {rank}: the ranks of process group {ledger.key} are in different collective calls{shown}: "
            f"{where}. Nothing was exchanged, so ranks that catch this error may go on together; {CALLS}")
