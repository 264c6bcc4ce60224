"""One batch: moving it to the model's device, calling the engine with it, finding the loss (docs/trainer.md).

With a ``loss_fn``, a tuple longer than the positional parameters the model's ``forward`` takes passes only the leading
items; the rest are targets for ``loss_fn(output, batch)``, as in Keras or Lightning.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch

__all__ = ["BatchError", "LossFn", "compute_loss", "describe", "forward", "measure", "positional_arity", "to_device"]

#: ``loss_fn(output, batch) -> scalar loss tensor``
LossFn = Callable[[Any, Any], torch.Tensor]


class BatchError(TypeError):
    """The model rejected a batch, or its output holds no loss; the message shows the batch's structure."""


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor inside (tuples, lists, dicts, nested) moved to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


def describe(batch: Any) -> str:
    """The batch's structure: keys or positions, with each tensor's shape and dtype."""
    if isinstance(batch, torch.Tensor):
        return f"tensor{tuple(batch.shape)} {str(batch.dtype).replace('torch.', '')}"
    if isinstance(batch, Mapping):
        return "{" + ", ".join(f"{key!r}: {describe(value)}" for key, value in batch.items()) + "}"
    if isinstance(batch, (tuple, list)):
        inner = ", ".join(describe(value) for value in batch)
        return f"({inner},)" if isinstance(batch, tuple) and len(batch) == 1 else f"{type(batch).__name__}[{inner}]"
    return type(batch).__name__


def positional_arity(module: Any) -> Optional[int]:
    """How many positional arguments ``module.forward`` takes (None: any number, or unknown)."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError, AttributeError):
        return None
    kinds = [p.kind for p in parameters]
    if inspect.Parameter.VAR_POSITIONAL in kinds:
        return None
    return sum(kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) for kind in kinds)


def forward(engine: Any, batch: Any, arity: Optional[int] = None) -> Any:
    """``engine`` called with ``batch`` unpacked by its type; an error names the batch's structure.

    ``arity`` (:func:`positional_arity`) cuts a longer tuple/list batch to the arguments ``forward`` takes.
    """
    try:
        if isinstance(batch, Mapping):
            return engine(**batch)
        if isinstance(batch, (tuple, list)):
            return engine(*(batch[:arity] if arity else batch))
        return engine(batch)
    except (TypeError, ValueError, RuntimeError, IndexError, KeyError) as error:
        how = "engine(**batch)" if isinstance(batch, Mapping) else "engine(*batch)" if isinstance(batch, (tuple, list)) else "engine(batch)"
        raise BatchError(
            f"the model's forward failed on a batch {describe(batch)}, called as `{how}`: "
            f"{type(error).__name__}: {error}. A tuple/list batch is passed as positional arguments, a dict as "
            "keyword arguments: shape the batch for the model's `forward` (e.g. with `collate_fn=`)") from error


def compute_loss(output: Any, batch: Any, loss_fn: Optional[LossFn]) -> torch.Tensor:
    """The scalar loss of one forward: ``loss_fn(output, batch)``, the output, ``output["loss"]`` or ``output.loss``."""
    loss: Any
    if loss_fn is not None:
        loss = loss_fn(output, batch)
    elif isinstance(output, torch.Tensor):
        loss = output
    elif isinstance(output, Mapping) and "loss" in output:
        loss = output["loss"]
    else:
        loss = getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise BatchError(
            f"no scalar loss in the model's output {describe(output)} (batch {describe(batch)}): the trainer "
            "takes the output itself, `output['loss']` or `output.loss`; pass `loss_fn=lambda output, batch: ...` "
            "to compute it")
    return loss.reshape(())


def measure(batch: Any) -> tuple[int, Optional[int]]:
    """How much data a batch holds: ``(samples, tokens)``, the first dim of its first tensor and, when that
    holds integer ids of rank >= 2, its elements (None otherwise)."""
    first = _first_tensor(batch)
    if first is None or first.dim() == 0:
        return 1, None
    return first.shape[0], first.numel() if first.dim() >= 2 and not first.is_floating_point() else None


def _first_tensor(batch: Any) -> Optional[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else ()
    for value in values:
        found = _first_tensor(value)
        if found is not None:
            return found
    return None
