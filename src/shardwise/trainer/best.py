"""Watching a metric: which evaluation was best (for the best checkpoint and ``EarlyStopping``).

Evaluation results are reduced over all ranks before anyone sees them, so
every rank's :class:`Watch` takes the same decisions without talking.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["Watch", "metric_key"]


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
