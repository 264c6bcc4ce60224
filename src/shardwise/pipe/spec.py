"""Layer specs: what to build, built only on the stage that runs it.

A :class:`LayerSpec` is a recipe, ``cls(*args, **kwargs)``; a pipeline rank
builds only the specs of its own stage, so a model too big for one rank never
exists whole anywhere.  A :class:`TiedLayerSpec` adds a key: every occurrence
of the key on a stage is one module instance (a token embedding reused as the
output head), and across stages the tied parameters are kept equal by the
pipeline engine.

Partitioning needs each layer's size and the tie check needs the tied
parameters' shapes before anything is built for real: :func:`build_on_meta`
builds a spec on the ``meta`` device, which allocates no memory.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence, Union

import torch
from torch import nn

__all__ = ["LayerSpec", "TiedLayerSpec", "build_on_meta", "layer_name"]


class LayerSpec:
    """A layer to build later, on the stage that runs it: ``cls(*args, **kwargs)``.

    ``cls`` is an ``nn.Module`` class (or any callable returning a module).
    """

    def __init__(self, cls: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> None:
        if not callable(cls):
            raise TypeError(
                f"LayerSpec needs a module class (or a callable returning a module) as its first argument, "
                f"got a `{type(cls).__name__}`; write `LayerSpec(nn.Linear, 4, 4)`"
            )
        self.cls = cls
        self.args = args
        self.kwargs = kwargs

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
                "module (pass plain functions in `layers` directly, without a spec)"
            )
        return module

    def __repr__(self) -> str:
        parts = [self.name, *map(repr, self.args), *(f"{k}={v!r}" for k, v in self.kwargs.items())]
        return f"{type(self).__name__}({', '.join(parts)})"


class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared by every occurrence of ``key``.

    On one stage all occurrences of ``key`` are one module instance, built from
    the first occurrence.  ``forward_fn(module, x)``, when given, replaces the
    module's forward for this occurrence (a tied head: ``F.linear(x,
    module.weight)``).  ``tied_weight_attr`` names the parameter(s) kept equal
    across the stages that hold the key (dotted names reach into submodules);
    their shapes must agree between occurrences.
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
                "`tied_modules.<key>`); use e.g. `'embed'`"
            )
        if forward_fn is not None and not callable(forward_fn):
            raise TypeError(f"TiedLayerSpec `{key}`: forward_fn must be callable `(module, x) -> y`, got {forward_fn!r}")
        self.key = key
        self.forward_fn = forward_fn
        attrs = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        if not attrs or not all(isinstance(a, str) and a for a in attrs):
            raise ValueError(
                f"TiedLayerSpec `{key}`: tied_weight_attr {tied_weight_attr!r} must be a parameter name or a "
                "non-empty list of them, e.g. `'weight'` or `['weight', 'bias']`"
            )
        self.tied_weight_attr = attrs

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, key={self.key!r})"


def layer_name(layer: Any) -> str:
    """The class name of a layer entry: a spec's class, a module's type, a callable's type."""
    if isinstance(layer, LayerSpec):
        return layer.name
    return type(layer).__name__


@contextlib.contextmanager
def _untouched_rng() -> Iterator[None]:
    # Counting parameters must not move the user's random stream.
    with torch.random.fork_rng(devices=[]):
        yield


def build_on_meta(spec: LayerSpec) -> nn.Module:
    """Build ``spec`` without allocating: on the ``meta`` device, or on the CPU if its
    constructor cannot run there (it reads values, say).  The RNG is left as it was."""
    with _untouched_rng():
        try:
            with torch.device("meta"):
                return spec.build()
        except TypeError:
            raise
        except Exception:  # noqa: BLE001 - a constructor that needs real values; build it for real
            return spec.build()
