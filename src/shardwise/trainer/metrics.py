"""Metrics: throughput between log points (evaluation and saves left out), the JSON-lines file (one record per
logged step; its fields in docs/trainer.md), and its curves as a PNG. Non-finite numbers (an fp16 overflow's grad norm)
are written as ``null``.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..checkpoint.commit import write_atomic

__all__ = ["Meter", "MetricsFile", "plot_metrics", "read_metrics"]


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

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside counts in neither the interval's rates nor the whole run's."""
        start = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            self.mark, self.step_mark, self.excluded = self.mark + spent, self.step_mark + spent, self.excluded + spent

    def add(self, samples: int, tokens: int) -> dict[str, Optional[float]]:
        """Count one step; returns its own rates (``samples_per_s``, ``tokens_per_s``) for the display."""
        now = time.perf_counter()
        seconds, self.step_mark = max(now - self.step_mark, 1e-9), now
        self.steps, self.samples, self.tokens = self.steps + 1, self.samples + samples, self.tokens + tokens
        self.total_steps, self.total_samples = self.total_steps + 1, self.total_samples + samples
        self.total_tokens += tokens
        return {"samples_per_s": samples / seconds, "tokens_per_s": tokens / seconds if tokens else None}

    def interval(self) -> dict[str, Optional[float]]:
        """Rates since the last call (then starts a new interval)."""
        now = time.perf_counter()
        seconds = max(now - self.mark, 1e-9)
        rates = {"step_time": seconds / self.steps if self.steps else None, "samples_per_s": self.samples / seconds,
                 "tokens_per_s": self.tokens / seconds if self.tokens else None}
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

    def plot(self, message: Callable[[str], None]) -> Optional[str]:
        """Draw ``metrics.png`` next to the file (rank 0); says in one ``message`` why when it cannot."""
        if self.path is None or not self.path.is_file():
            return None
        try:
            return str(plot_metrics(self.path, self.path.with_suffix(".png")))
        except (ImportError, ValueError, OSError) as error:
            message(f"no curves drawn: {error}")
            return None


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


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and "step" in r]
    return [p[0] for p in points], [float(p[1]) for p in points]


def plot_metrics(metrics_file: Any, out: Any) -> Path:
    """Draw train/eval loss and lr against step from ``metrics_file`` into ``out`` (a PNG; needs matplotlib:
    ``pip install 'shardwise[plot]'``); returns ``out``."""
    try:
        # here: matplotlib takes ~0.5 s to import, paid only when a plot is drawn
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            f"plotting needs matplotlib ({error}); install it with `pip install 'shardwise[plot]'`") from error
    records = read_metrics(metrics_file)
    steps, losses = _series(records, "loss")
    if not steps:
        raise ValueError(f"{metrics_file} has no records with `step` and `loss`; is it a shardwise metrics file?")
    # The object API (no pyplot): no global figure state, no display backend needed.
    figure = Figure(figsize=(9, 3.6), layout="constrained")
    FigureCanvasAgg(figure)
    loss_axes, lr_axes = figure.subplots(1, 2)
    loss_axes.plot(steps, losses, label="train")
    eval_steps, eval_losses = _series(records, "eval_loss")
    if eval_steps:
        loss_axes.plot(eval_steps, eval_losses, "o-", label="eval")
    loss_axes.set(xlabel="step", ylabel="loss", title="loss")
    loss_axes.legend()
    loss_axes.grid(alpha=0.3)
    lr_axes.plot(*_series(records, "lr"), color="tab:green")
    lr_axes.set(xlabel="step", ylabel="learning rate", title="learning rate")
    lr_axes.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    lr_axes.grid(alpha=0.3)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    return out
