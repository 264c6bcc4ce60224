"""A pipeline's layers: specs built only where they run, and running a list of layers (docs/pipeline.md).

A :class:`LayerSpec` is built only on the rank whose stage holds it, so a model too big for one rank never exists whole
anywhere; :func:`build_on_meta` builds one on the ``meta`` device (no memory) for partitioning and the tie check.
:class:`~.module.PipelineModule` and :class:`PipelineSequential` both run through :func:`run_layers`, so both
checkpoint the same way.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
import torch.utils.checkpoint
from torch import nn

__all__ = ["CheckpointFn", "Layer", "LayerSpec", "PipelineSequential", "TiedLayerSpec", "build_on_meta",
           "compute_loss", "default_checkpoint", "layer_name", "run_layers"]

Layer = Callable[[Any], Any]
#: ``fn(function, *args)`` runs ``function(*args)`` and recomputes it in backward
CheckpointFn = Callable[..., Any]

#: torch's non-reentrant checkpoint: works with inputs that need no gradient,
#: keyword-free tuples, and ZeRO-3 (the recomputation runs the module hooks again)
default_checkpoint: CheckpointFn = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)


class _Chunk:
    """A run of consecutive layers, called with the activation unpacked (as checkpoint functions want)."""

    def __init__(self, layers: Sequence[Layer], packed: bool) -> None:
        self.layers, self.packed = layers, packed

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
            "`PipelineModule(..., loss_fn=fn)` with `fn(outputs, labels) -> loss`")
    return loss_fn(outputs, labels)


class PipelineSequential(nn.Module):
    """Every layer of a ``PipelineModule``, in order, as an ordinary module.

    It shares the pipeline module's layer objects under the same names (a checkpoint of either loads into the other).
    ``forward(inputs)`` returns the last layer's output, ``forward(inputs, labels)`` the loss. It needs no process
    group and trains under ``shardwise.initialize`` at any ZeRO stage.
    """

    def __init__(self, children: Iterable[tuple[str, nn.Module]], steps: list[Layer], loss_fn: Optional[Any],
                 checkpoint_interval: int, checkpoint_func: CheckpointFn) -> None:
        super().__init__()
        for name, child in children:
            self.add_module(name, child)
        self.loss_fn = loss_fn
        self._steps = list(steps)
        self.activation_checkpoint_interval, self.activation_checkpoint_func = checkpoint_interval, checkpoint_func

    def forward(self, inputs: Any, labels: Any = None) -> Any:
        outputs = run_layers(self._steps, inputs, self.activation_checkpoint_interval, self.activation_checkpoint_func)
        return outputs if labels is None else compute_loss(self.loss_fn, outputs, labels)

    def extra_repr(self) -> str:
        return f"{len(self._steps)} layers, activation_checkpoint_interval={self.activation_checkpoint_interval}"


class LayerSpec:
    """A layer to build later, on the stage that runs it: ``cls(*args, **kwargs)``.

    ``cls`` is an ``nn.Module`` class (or any callable returning a module).
    """

    def __init__(self, cls: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> None:
        if not callable(cls):
            raise TypeError(
                f"LayerSpec needs a module class (or a callable returning a module) as its first argument, "
                f"got a `{type(cls).__name__}`; write `LayerSpec(nn.Linear, 4, 4)`")
        self.cls, self.args, self.kwargs = cls, args, kwargs

    @property
    def name(self) -> str:
        """The class name (what ``partition_method="type:REGEX"`` matches)."""
        return str(getattr(self.cls, "__name__", type(self.cls).__name__))

    def build(self) -> nn.Module:
        """Construct the module."""
        module = self.cls(*self.args, **self.kwargs)
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"{self!r} built a `{type(module).__name__}`, not an `nn.Module`; a LayerSpec must build a "
                "module (pass plain functions in `layers` directly, without a spec)")
        return module

    def __repr__(self) -> str:
        parts = [self.name, *map(repr, self.args), *(f"{k}={v!r}" for k, v in self.kwargs.items())]
        return f"{type(self).__name__}({', '.join(parts)})"


class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared by every occurrence of ``key``.

    On one stage all occurrences of ``key`` are one module instance. ``forward_fn(module, x)`` replaces its forward for
    this occurrence (a tied head: ``F.linear(x, module.weight)``); ``tied_weight_attr`` names the parameter(s) kept
    equal across the stages that hold the key (dotted names reach into submodules).
    """

    def __init__(
        self,
        key: str,
        cls: Callable[..., nn.Module],
        *args: Any,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        tied_weight_attr: Union[str, Sequence[str]] = "weight",
        **kwargs: Any,
    ) -> None:
        super().__init__(cls, *args, **kwargs)
        if not isinstance(key, str) or not key or "." in key:
            raise ValueError(
                f"TiedLayerSpec key {key!r} must be a non-empty string without `.` (it names a submodule, "
                "`tied_modules.<key>`); use e.g. `'embed'`")
        if forward_fn is not None and not callable(forward_fn):
            raise TypeError(f"TiedLayerSpec `{key}`: forward_fn must be callable `(module, x) -> y`, got {forward_fn!r}")
        self.key, self.forward_fn = key, forward_fn
        attrs = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        if not attrs or not all(isinstance(a, str) and a for a in attrs):
            raise ValueError(
                f"TiedLayerSpec `{key}`: tied_weight_attr {tied_weight_attr!r} must be a parameter name or a "
                "non-empty list of them, e.g. `'weight'` or `['weight', 'bias']`")
        self.tied_weight_attr = attrs

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, key={self.key!r})"


def layer_name(layer: Any) -> str:
    """The class name of a layer entry: a spec's class, a module's type, a callable's type."""
    return layer.name if isinstance(layer, LayerSpec) else type(layer).__name__


def build_on_meta(spec: LayerSpec) -> nn.Module:
    """Build ``spec`` without allocating: on the ``meta`` device, or on the CPU if its
    constructor cannot run there (it reads values, say).  The RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):  # counting parameters must not move the user's random stream
        try:
            with torch.device("meta"):
                return spec.build()
        except TypeError:
            raise
        except Exception:  # noqa: BLE001 - a constructor that needs real values; build it for real
            return spec.build()
