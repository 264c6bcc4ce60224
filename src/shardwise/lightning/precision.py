"""The precision plugin of a ``ShardwiseStrategy``: Lightning's precision flag, carried out by the engine.

The strategy keeps only the flag of the plugin the Trainer picked (:data:`.config.PRECISIONS` maps it onto the
engine's ``bf16``/``fp16`` sections) and uses this plugin, which leaves the module and inputs to the engine's
casts and sends ``backward`` and the optimizer step to the engine (it scales, reduces, unscales and clips).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Optional

from torch import nn

from .flavour import Flavour

__all__ = ["ShardwisePrecision", "precision_class"]

if TYPE_CHECKING:
    _Base = Any
else:
    _Base = object


class ShardwisePrecision(_Base):
    """Lightning's ``Precision`` for the engine (built per Lightning package by :func:`precision_class`)."""

    def __init__(self, precision: str = "32-true", chosen_by: str = "") -> None:
        super().__init__()
        #: the Trainer's flag (``"32-true"``, ``"bf16-mixed"``, ...)
        self.precision = precision
        #: the plugin the Trainer chose, when it was not this one (named in errors)
        self.chosen_by = chosen_by

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module  # the engine casts it (keeping fp32 masters)

    def convert_input(self, data: Any) -> Any:
        return data  # the engine casts floating inputs in its forward

    def backward(self, tensor: Any, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        model.trainer.strategy.engine.backward(tensor, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        result = closure()
        self._after_closure(model, optimizer)
        if model.automatic_optimization and result is None:
            raise RuntimeError("`training_step` returned None, which skips the backward; ShardwiseStrategy steps the "
                               "engine after every backward (as DeepSpeedStrategy): return a loss from every "
                               "`training_step`")
        return model.trainer.strategy.step_engine()

    def clip_gradients(self, optimizer: Any, clip_val: Any = 0.0, gradient_clip_algorithm: Any = None) -> None:
        """Nothing here: the engine clips the reduced gradients by ``Trainer(gradient_clip_val=...)`` in its step."""


@functools.cache
def precision_class(flavour: Flavour) -> type:
    """:class:`ShardwisePrecision` on ``flavour``'s ``Precision``."""
    return type("ShardwisePrecision", (ShardwisePrecision, flavour.Precision), {"__module__": __name__})


def as_shardwise(flavour: Flavour, plugin: Optional[Any]) -> Optional[Any]:
    """The plugin a strategy keeps for ``plugin`` (the one the Trainer chose): its flag, on the engine."""
    if plugin is None or isinstance(plugin, ShardwisePrecision):
        return plugin
    return precision_class(flavour)(str(getattr(plugin, "precision", "unknown")), type(plugin).__name__)
