"""Evaluation results: ``compute_metrics`` over the whole eval set, and which evaluation was best.

``compute_metrics(predictions, labels)`` is called as Hugging Face's Trainer calls it, with every rank's predictions
gathered (docs/trainer.md). The results are reduced over all ranks before anyone sees them, so every rank's
:class:`Watch` (the best checkpoint, ``EarlyStopping``) takes the same decisions without talking.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["Collected", "ComputeMetrics", "Watch", "labels_of", "metric_key", "predictions_of"]

#: ``compute_metrics(predictions, labels) -> {name: number}``
ComputeMetrics = Callable[[torch.Tensor, Optional[torch.Tensor]], Mapping[str, float]]


def metric_key(name: str) -> str:
    """The eval record's key for ``name``: ``"loss"``, ``"eval_loss"`` and ``"accuracy"`` all work."""
    return name if name.startswith("eval_") else f"eval_{name}"


def predictions_of(output: Any) -> torch.Tensor:
    """The logits in a model's output (see the module docstring)."""
    for found in (getattr(output, "logits", None), output.get("logits") if isinstance(output, Mapping) else None,
                  output[0] if isinstance(output, (tuple, list)) and output else None, output):
        if isinstance(found, torch.Tensor):
            return found
    raise TypeError(
        f"`compute_metrics` needs predictions, and the model's output ({type(output).__name__}) holds no logits "
        "tensor: return a tensor, a tuple whose first item is one, or an object/dict with `logits`")


def labels_of(batch: Any) -> Optional[torch.Tensor]:
    """The labels in a batch (see the module docstring), or None."""
    if isinstance(batch, Mapping):
        found = batch.get("labels", batch.get("label"))
    else:
        found = batch[-1] if isinstance(batch, (tuple, list)) and len(batch) > 1 else None
    return found if isinstance(found, torch.Tensor) else None


class Collected:
    """One rank's predictions and labels, batch by batch."""

    def __init__(self) -> None:
        self.predictions: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []

    def add(self, output: Any, batch: Any) -> None:
        predictions = predictions_of(output).detach()
        self.predictions.append(predictions.float().cpu() if predictions.is_floating_point() else predictions.cpu())
        labels = labels_of(batch)
        if labels is not None:
            self.labels.append(labels.detach().cpu())

    def compute(self, gather: Callable[[Any], list[Any]], compute_metrics: ComputeMetrics) -> dict[str, float]:
        """Every rank's collections joined in rank order, then ``compute_metrics``; collective."""
        everyone = gather((self.predictions, self.labels))
        predictions = torch.cat([p for preds, _ in everyone for p in preds])
        label_parts = [x for _, labels in everyone for x in labels]
        result = compute_metrics(predictions, torch.cat(label_parts) if label_parts else None)
        if not isinstance(result, Mapping):
            raise TypeError(f"`compute_metrics` returned {type(result).__name__}; expected a dict of name -> number")
        return {metric_key(key): float(value) for key, value in result.items()}


@dataclass
class Watch:
    """The best value of one eval metric so far and the step it came at."""

    name: str
    greater_is_better: bool = False
    min_delta: float = 0.0
    best: Optional[float] = None
    best_step: Optional[int] = None

    def update(self, metrics: dict[str, Any]) -> bool:
        """Take an evaluation's metrics; True when it is the new best."""
        key = metric_key(self.name)
        value = metrics.get(key)
        if not isinstance(value, (int, float)):
            known = sorted(k for k in metrics if k.startswith("eval_"))
            raise KeyError(
                f"the monitored metric `{self.name}` (`{key}`) is not among the evaluation's results {known}: "
                "name one of them, or return it from `compute_metrics`")
        if math.isnan(value):
            return False
        if self.best is not None:
            gain = value - self.best if self.greater_is_better else self.best - value
            if gain <= self.min_delta:
                return False
        self.best, self.best_step = float(value), int(metrics["step"])
        return True
