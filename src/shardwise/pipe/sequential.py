"""What ``PipelineModule.to_sequential()`` returns: the layers as one plain module."""

from __future__ import annotations

from typing import Any, Iterable, Optional

from torch import nn

from .layers import CheckpointFn, Layer, compute_loss, run_layers

__all__ = ["PipelineSequential"]


class PipelineSequential(nn.Module):
    """Every layer of a ``PipelineModule``, in order, as an ordinary module.

    It shares the pipeline module's layer objects: ``tied_modules.<key>`` once
    per key, ``"<index>"`` for every other module layer (``children``, in the
    pipeline module's order), so the state-dict names are the pipeline's (a
    checkpoint of either loads into the other).  ``forward(inputs)`` returns
    the last layer's output; ``forward(inputs, labels)`` returns
    ``loss_fn(outputs, labels)``.  It needs no process group and trains under
    ``shardwise.initialize`` at any ZeRO stage.
    """

    def __init__(self, children: Iterable[tuple[str, nn.Module]], steps: list[Layer], loss_fn: Optional[Any],
                 checkpoint_interval: int, checkpoint_func: CheckpointFn) -> None:
        super().__init__()
        for name, child in children:
            self.add_module(name, child)
        self.loss_fn = loss_fn
        self._steps = list(steps)
        self.activation_checkpoint_interval = checkpoint_interval
        self.activation_checkpoint_func = checkpoint_func

    def forward(self, inputs: Any, labels: Any = None) -> Any:
        outputs = run_layers(self._steps, inputs, self.activation_checkpoint_interval, self.activation_checkpoint_func)
        return outputs if labels is None else compute_loss(self.loss_fn, outputs, labels)

    def extra_repr(self) -> str:
        return f"{len(self._steps)} layers, activation_checkpoint_interval={self.activation_checkpoint_interval}"
