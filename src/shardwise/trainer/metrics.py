"""Metrics: throughput between log points (evaluation and saves left out), and the JSON-lines file (one record per logged step).

A record holds ``step``, ``epoch``, ``loss`` (mean over ranks and the step's
micro-batches), ``lr`` (first param group), ``grad_norm``, ``loss_scale``,
``step_time`` (seconds per step since the last record), ``samples_per_s``,
``tokens_per_s`` (when the batches are token ids) and ``memory`` (per rank,
:meth:`Engine.memory_breakdown`).  Evaluations add records with ``eval_loss``.
Non-finite numbers (an fp16 overflow's grad norm) are written as ``null``.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..checkpoint.commit import write_atomic

__all__ = ["Meter", "MetricsFile", "read_metrics"]


@dataclass
class Meter:
    """Steps, samples and tokens counted since the last log point, and over the whole ``fit()``."""

    started: float = field(default_factory=time.perf_counter)
    mark: float = field(default_factory=time.perf_counter)
    steps: int = 0
    samples: int = 0
    tokens: int = 0
    total_steps: int = 0
    total_samples: int = 0
    total_tokens: int = 0
    #: seconds spent outside training steps (evaluation, saves), left out of the rates
    excluded: float = 0.0
    #: when the last step ended (the start of the next one), for the per-step rate
    step_mark: float = field(default_factory=time.perf_counter)
    #: the last step's wall seconds
    last_step_seconds: float = math.nan

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside counts in neither the interval's rates nor the whole run's."""
        start = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            self.mark += spent
            self.step_mark += spent
            self.excluded += spent

    def add(self, samples: int, tokens: int) -> dict[str, Optional[float]]:
        """Count one step; returns its own rates (``samples_per_s``, ``tokens_per_s``) for the display."""
        now = time.perf_counter()
        self.last_step_seconds, self.step_mark = max(now - self.step_mark, 1e-9), now
        self.steps += 1
        self.samples += samples
        self.tokens += tokens
        self.total_steps += 1
        self.total_samples += samples
        self.total_tokens += tokens
        return {"samples_per_s": samples / self.last_step_seconds,
                "tokens_per_s": tokens / self.last_step_seconds if tokens else None}

    def interval(self) -> dict[str, Optional[float]]:
        """Rates since the last call (then starts a new interval)."""
        now = time.perf_counter()
        seconds = max(now - self.mark, 1e-9)
        rates = {
            "step_time": seconds / self.steps if self.steps else None,
            "samples_per_s": self.samples / seconds,
            "tokens_per_s": self.tokens / seconds if self.tokens else None,
        }
        self.mark, self.steps, self.samples, self.tokens = now, 0, 0, 0
        return rates

    def elapsed(self) -> float:
        """Wall seconds since the start, everything included."""
        return time.perf_counter() - self.started

    def training_seconds(self) -> float:
        """Wall seconds since the start, evaluation and saves left out."""
        return max(self.elapsed() - self.excluded, 1e-9)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class MetricsFile:
    """``metrics_file`` written by rank 0; a resumed run keeps the records up to the step it resumed from."""

    def __init__(self, path: Optional[str], enabled: bool) -> None:
        self.path = Path(path) if path is not None and enabled else None

    def start(self, resumed_from: Optional[int]) -> None:
        """Begin the file: empty for a fresh run; for a resumed one, drop records past ``resumed_from``.

        Rewritten atomically (a crash leaves the old file or the new one), and only when a record goes: a run
        resumed at its end leaves the file as it was.
        """
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        found = read_metrics(self.path) if resumed_from is not None and self.path.is_file() else []
        kept = [r for r in found if r.get("step", 0) <= resumed_from] if resumed_from is not None else []
        if self.path.is_file() and found and len(kept) == len(found):
            return
        write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept).encode("utf-8"))

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(_clean(record)) + "\n")


def read_metrics(path: Any) -> list[dict[str, Any]]:
    """The records of a metrics file (a line that is not JSON, e.g. cut short by a crash, is skipped)."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records
