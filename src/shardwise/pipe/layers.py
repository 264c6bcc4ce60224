"""Running a list of layers, with activation checkpointing every ``interval`` layers.

A layer is any callable taking one value (a tensor or a tuple of tensors) and
returning the next: a module, a function, a lambda, a bound method, a
``functools.partial``.  :class:`~.module.PipelineModule` (one stage) and the
module ``to_sequential()`` returns run their layers through :func:`run_layers`,
so both checkpoint the same way.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import torch
import torch.utils.checkpoint

__all__ = ["CheckpointFn", "Layer", "compute_loss", "default_checkpoint", "run_layers"]

Layer = Callable[[Any], Any]
#: ``fn(function, *args)`` runs ``function(*args)`` and recomputes it in backward
CheckpointFn = Callable[..., Any]

#: torch's non-reentrant checkpoint: works with inputs that need no gradient,
#: keyword-free tuples, and ZeRO-3 (the recomputation runs the module hooks again)
default_checkpoint: CheckpointFn = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)


class _Chunk:
    """A run of consecutive layers, called with the activation unpacked (as checkpoint functions want)."""

    def __init__(self, layers: Sequence[Layer], packed: bool) -> None:
        self.layers = layers
        self.packed = packed

    def __call__(self, *args: Any) -> Any:
        value: Any = args if self.packed else args[0]
        for layer in self.layers:
            value = layer(value)
        return value


def run_layers(layers: Sequence[Layer], value: Any, interval: int = 0, checkpoint: CheckpointFn = default_checkpoint) -> Any:
    """Feed ``value`` through ``layers``; with ``interval > 0`` and grad enabled, every
    ``interval`` consecutive layers run under ``checkpoint`` (activations recomputed in backward)."""
    if interval <= 0 or not torch.is_grad_enabled():
        return _Chunk(layers, False)(value)
    for start in range(0, len(layers), interval):
        chunk = layers[start : start + interval]
        packed = isinstance(value, tuple)
        value = checkpoint(_Chunk(chunk, packed), *(value if packed else (value,)))
    return value


def compute_loss(loss_fn: Optional[Callable[[Any, Any], torch.Tensor]], outputs: Any, labels: Any) -> torch.Tensor:
    """``loss_fn(outputs, labels)``; without a loss_fn the outputs must already be the loss."""
    if loss_fn is None:
        if isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
            return outputs
        raise ValueError(
            "the pipeline has no `loss_fn` and its last layer's output is not a scalar loss; pass "
            "`PipelineModule(..., loss_fn=fn)` with `fn(outputs, labels) -> loss`"
        )
    return loss_fn(outputs, labels)
