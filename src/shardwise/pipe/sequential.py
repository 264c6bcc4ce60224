"""What ``PipelineModule.to_sequential()`` returns: the layers as one plain module."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from .layers import compute_loss, run_layers

if TYPE_CHECKING:
    from .module import PipelineModule

__all__ = ["PipelineSequential"]


class PipelineSequential(nn.Module):
    """Every layer of a :class:`PipelineModule`, in order, as an ordinary module.

    It shares the pipeline module's layer objects: ``tied_modules.<key>`` once
    per key, ``"<index>"`` for every other module layer, so the state-dict
    names are the pipeline's (a checkpoint of either loads into the other).
    ``forward(inputs)`` returns the last layer's output; ``forward(inputs,
    labels)`` returns ``loss_fn(outputs, labels)``.  It needs no process group
    and trains under ``shardwise.initialize`` at any ZeRO stage.
    """

    def __init__(self, source: "PipelineModule") -> None:
        super().__init__()
        self.tied_modules = source.tied_modules
        for name, child in source.named_children():
            if name != "tied_modules" and child is not source.loss_fn:
                self.add_module(name, child)
        self.loss_fn = source.loss_fn
        self._steps = list(source._steps)
        self.activation_checkpoint_interval = source.activation_checkpoint_interval
        self.activation_checkpoint_func = source.activation_checkpoint_func

    def forward(self, inputs: Any, labels: Any = None) -> Any:
        outputs = run_layers(self._steps, inputs, self.activation_checkpoint_interval, self.activation_checkpoint_func)
        return outputs if labels is None else compute_loss(self.loss_fn, outputs, labels)

    def extra_repr(self) -> str:
        return f"{len(self._steps)} layers, activation_checkpoint_interval={self.activation_checkpoint_interval}"
