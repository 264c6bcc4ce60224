"""Ranks that built different engines are stopped at ``initialize``, naming the first difference.

The ranks' payloads at their store meeting (:func:`shardwise.comm.agreement.join`) carry the digests of
:mod:`.fingerprint`, so agreeing costs nothing more than the meeting.  Only when a digest differs do they
exchange the entries behind it, in one more step of the same session, and every rank raises
:class:`~shardwise.faults.CollectiveMismatchError` naming the first difference with its value on each rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

from torch import nn

from ..config import Config
from ..faults.errors import CollectiveMismatchError
from .agreement import Session
from .fingerprint import PER_RANK_KEYS, Fingerprint, client_fingerprint, config_fingerprint, module_fingerprint

__all__ = ["digests", "engine_fingerprints", "require_same_construction"]

#: how many distinct values (each with its ranks) a message lists before "and N more"
_MAX_SHOWN_VALUES = 4
_MAX_SHOWN_RANKS = 8
_ABSENT = "(absent)"

_FIXES = {
    "parameters": (
        "Build the same model on every rank: the same submodules registered in the same order, with the same "
        "shapes, dtypes and `requires_grad` (a model built by iterating a `set` registers its modules in a "
        "different order in each process: iterate `sorted(...)` instead)"),
    "config": (
        "Pass the same config on every rank; only "
        + ", ".join(f"`{key}`" for key in sorted(PER_RANK_KEYS)) + " may differ between ranks (docs/faults.md)"),
    "client": (
        "Pass the same optimizer (type, param groups and their hyperparameters), `lr_scheduler` and "
        "`model_parameters` to `initialize` on every rank"),
}


def engine_fingerprints(module: nn.Module, config: Config, optimizer: Any, lr_scheduler: Any,
                        model_parameters: Optional[list[Any]]) -> dict[str, Fingerprint]:
    """What the ranks of one engine compare: its model, its config, and what was passed besides."""
    return {"parameters": module_fingerprint(module), "config": config_fingerprint(config),
            "client": client_fingerprint(module, optimizer, lr_scheduler, model_parameters)}


def digests(fingerprints: Mapping[str, Fingerprint]) -> dict[str, str]:
    """What a rank puts in its payload: each fingerprint's digest."""
    return {part: fingerprint.digest for part, fingerprint in fingerprints.items()}


def require_same_construction(session: Session, fingerprints: Mapping[str, Fingerprint], label: str) -> None:
    """Raise on every rank if any rank's payload ``fingerprints`` digests differ from rank 0's.

    Every rank sees the same payloads, so every rank takes the same branch: on a mismatch all of them exchange
    the entries of the differing fingerprints (one more step of ``session``) and raise the same error.
    """
    differing = _differing(session.payloads, list(fingerprints))
    if not differing:
        return
    mine = {part: [list(entry) for entry in fingerprints[part].entries] for part in differing}
    _, theirs = session.step("comparing what each rank built at `initialize`", lambda: mine, share=True)
    part = differing[0]
    per_rank = [_entries(details, part) for details in theirs]
    message = _describe(session.rank, label, fingerprints[part].what, per_rank)
    others = [fingerprints[p].what for p in differing[1:]]
    also = f" Their {' and '.join(others)} differ too." if others else ""
    raise CollectiveMismatchError(f"{message}.{also} {_FIXES.get(part, '')}", rank=session.rank)


def _differing(payloads: Sequence[Mapping[str, Any]], parts: list[str]) -> list[str]:
    def of(payload: Mapping[str, Any], part: str) -> Any:
        found = payload.get("fingerprints")
        return found.get(part) if isinstance(found, dict) else None

    return [part for part in parts if any(of(p, part) != of(payloads[0], part) for p in payloads)]


def _entries(details: Any, part: str) -> list[tuple[str, str]]:
    """One rank's entries of ``part`` as it sent them (anything malformed reads as no entries)."""
    found = details.get(part) if isinstance(details, dict) else None
    if not isinstance(found, list):
        return []
    return [(str(e[0]), str(e[1])) for e in found if isinstance(e, list) and len(e) == 2]


def _describe(rank: int, label: str, what: str, per_rank: list[list[tuple[str, str]]]) -> str:
    head = f"rank {rank}: the ranks built different engines at `shardwise.initialize` ({label}): their {what} differ"
    key, values = _first_difference(per_rank)
    counts = [len(entries) for entries in per_rank]
    sizes = "" if len(set(counts)) == 1 else f" ({_by_rank([str(c) for c in counts])} entries)"
    text = f"{head}{sizes}. The first difference is {key}: {_by_rank(values)}"
    if _reordered(per_rank):
        text += "; the same entries, in a different order"
    return text


def _first_difference(per_rank: list[list[tuple[str, str]]]) -> tuple[str, list[str]]:
    maps = [dict(entries) for entries in per_rank]
    order = list(dict.fromkeys(key for entries in per_rank for key, _ in entries))
    for key in order:
        values = [m.get(key, _ABSENT) for m in maps]
        if any(v != values[0] for v in values):
            return f"`{key}`" if "#" not in key else key, values
    return "not in the entries (their digests differ only)", ["?" for _ in per_rank]


def _reordered(per_rank: list[list[tuple[str, str]]]) -> bool:
    """Whether every rank has the same values, only in another order."""
    values = [sorted(value for _, value in entries) for entries in per_rank]
    return all(v == values[0] for v in values) and any(e != per_rank[0] for e in per_rank)


def _by_rank(values: list[str]) -> str:
    """``rank 0: a, rank 1: b``, ranks with the same value grouped, at most a few distinct values."""
    groups: dict[str, list[int]] = {}
    for r, value in enumerate(values):
        groups.setdefault(value, []).append(r)
    shown = []
    for value, ranks in list(groups.items())[:_MAX_SHOWN_VALUES]:
        listed = ", ".join(map(str, ranks[:_MAX_SHOWN_RANKS])) + (" …" if len(ranks) > _MAX_SHOWN_RANKS else "")
        shown.append(f"rank{'s' if len(ranks) > 1 else ''} {listed}: {value}")
    more = len(groups) - _MAX_SHOWN_VALUES
    return "; ".join(shown) + (f"; and {more} more values" if more > 0 else "")
