"""Watching a metric: which evaluation was best (for the best checkpoint), and how long since (early stopping).

Evaluation results are reduced over all ranks before anyone sees them, so
every rank's :class:`Watch` takes the same decisions without talking.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from .callbacks import Callback

if TYPE_CHECKING:
    from .loop import Trainer

__all__ = ["EarlyStopping", "Watch", "metric_key"]


def metric_key(name: str) -> str:
    """The eval record's key for ``name``: ``"loss"``, ``"eval_loss"`` and ``"accuracy"`` all work."""
    return name if name.startswith("eval_") else f"eval_{name}"


@dataclass
class Watch:
    """The best value of one eval metric so far and the step it came at."""

    name: str
    greater_is_better: bool = False
    min_delta: float = 0.0
    best: Optional[float] = None
    best_step: Optional[int] = None

    def value(self, metrics: dict[str, Any]) -> float:
        key = metric_key(self.name)
        value = metrics.get(key)
        if not isinstance(value, (int, float)):
            known = sorted(k for k in metrics if k.startswith("eval_"))
            raise KeyError(
                f"the monitored metric `{self.name}` (`{key}`) is not among the evaluation's results {known}: "
                "name one of them, or return it from `compute_metrics`")
        return float(value)

    def improves(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        gain = value - self.best if self.greater_is_better else self.best - value
        return gain > self.min_delta

    def update(self, metrics: dict[str, Any]) -> bool:
        """Take an evaluation's metrics; True when it is the new best."""
        value = self.value(metrics)
        if not self.improves(value):
            return False
        self.best, self.best_step = value, int(metrics["step"])
        return True


class EarlyStopping(Callback):
    """Stops training once ``patience`` evaluations in a row did not improve ``metric`` by more than ``min_delta``."""

    def __init__(self, metric: str = "eval_loss", patience: int = 3, greater_is_better: bool = False,
                 min_delta: float = 0.0) -> None:
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"`EarlyStopping(patience={patience!r})`: expected an integer >= 1")
        self.watch = Watch(metric, greater_is_better, min_delta)
        self.patience = patience
        self.waited = 0

    def on_eval_end(self, trainer: "Trainer", metrics: dict[str, Any]) -> None:
        if self.watch.update(metrics):
            self.waited = 0
            return
        self.waited += 1
        if self.waited >= self.patience:
            trainer.request_stop(
                f"early stopping: `{self.watch.name}` has not improved on {self.watch.best:.6g} (step "
                f"{self.watch.best_step}) for {self.waited} evaluation(s)")
