"""``compute_metrics(predictions, labels)`` over the whole eval set, as Hugging Face's Trainer calls it.

Each rank keeps its batches' predictions and labels (on the CPU); at the end
they are gathered in rank order and concatenated, and every rank calls
``compute_metrics`` with the same tensors, so every rank gets the same
numbers.  Predictions are the output's logits: ``output.logits``,
``output["logits"]``, the first item of a tuple output, or the output itself.
Labels are ``batch["labels"]`` (or ``"label"``), or the last item of a tuple
batch.  Like Hugging Face, this holds every prediction of the eval set at
once: for a language model, reduce them first (e.g. ``argmax``) with
``preprocess=``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch

__all__ = ["ComputeMetrics", "Collected", "labels_of", "predictions_of"]

#: ``compute_metrics(predictions, labels) -> {name: number}``
ComputeMetrics = Callable[[torch.Tensor, Optional[torch.Tensor]], Mapping[str, float]]


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
    elif isinstance(batch, (tuple, list)) and len(batch) > 1:
        found = batch[-1]
    else:
        found = None
    return found if isinstance(found, torch.Tensor) else None


class Collected:
    """One rank's predictions and labels, batch by batch."""

    def __init__(self, preprocess: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        self.preprocess = preprocess
        self.predictions: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []

    def add(self, output: Any, batch: Any) -> None:
        predictions = predictions_of(output).detach()
        if self.preprocess is not None:
            predictions = self.preprocess(predictions)
        self.predictions.append(predictions.float().cpu() if predictions.is_floating_point() else predictions.cpu())
        labels = labels_of(batch)
        if labels is not None:
            self.labels.append(labels.detach().cpu())

    def compute(self, gather: Callable[[Any], list[Any]], compute_metrics: ComputeMetrics) -> dict[str, float]:
        """Every rank's collections joined in rank order, then ``compute_metrics``; collective."""
        everyone = gather((self.predictions, self.labels))
        predictions = torch.cat([p for preds, _ in everyone for p in preds])
        label_parts = [x for _, labels in everyone for x in labels]
        labels = torch.cat(label_parts) if label_parts else None
        result = compute_metrics(predictions, labels)
        if not isinstance(result, Mapping):
            raise TypeError(f"`compute_metrics` returned {type(result).__name__}; expected a dict of name -> number")
        return {_name(key): float(value) for key, value in result.items()}


def _name(key: str) -> str:
    return key if key.startswith("eval_") else f"eval_{key}"
