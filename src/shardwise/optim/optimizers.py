"""Optimizers: building one from config, accepting the user's, and the base class.

shardwise never reimplements an optimizer.  Whatever the user hands over (a ``torch.optim.Optimizer``, a
callable ``params -> optimizer``, or a fairseq-style wrapper exposing ``param_groups``/``step``/``zero_grad``/
``state_dict``/``load_state_dict``) becomes the *inner* optimizer, whose param groups a ZeRO strategy points at
this rank's fp32 master pieces.  ``engine.optimizer`` is a :class:`ShardwiseOptimizer` (``isinstance`` tells it).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Iterable, Optional, Union

import torch

from ..config import Config, OptimizerConfig
from ..config.registry import OPTIMIZERS

__all__ = ["ShardwiseOptimizer", "build_optimizer", "is_optimizer_like", "resolve_optimizer"]

_REQUIRED = ("param_groups", "step", "zero_grad", "state_dict", "load_state_dict")

OptimizerArg = Union[torch.optim.Optimizer, Callable[..., Any], Any, None]


def is_optimizer_like(obj: Any) -> bool:
    """True for a torch Optimizer or any object exposing the optimizer protocol."""
    return all(hasattr(obj, name) for name in _REQUIRED) and not isinstance(obj, type)


def build_optimizer(config: OptimizerConfig, params: Iterable[Any]) -> torch.optim.Optimizer:
    """Build a torch optimizer from a validated ``optimizer {type, params}`` section (its names and DeepSpeed's Adam
    extras: :class:`~shardwise.config.sections.OptimizerConfig`), from the one registry, ``registry.OPTIMIZERS``."""
    spec = OPTIMIZERS.get(config.type)
    if spec is None:  # a hand-built section that skipped validation
        raise ValueError(f"optimizer.type `{config.type}` is not supported; use one of {sorted(OPTIMIZERS)}")
    cls, kwargs = spec.build_with(config.params)
    return cls(params, **kwargs)


def resolve_optimizer(optimizer: OptimizerArg, config: Config, params: list[Any]) -> Optional[Any]:
    """Turn the ``optimizer`` argument of ``initialize`` into an optimizer over ``params`` (parameters or param-group
    dicts); None for an inference-only engine (no optimizer argument and none in config)."""
    if optimizer is None:
        return build_optimizer(config.optimizer, params) if config.optimizer is not None else None
    if config.optimizer is not None:
        raise ValueError(
            "an optimizer was passed to `shardwise.initialize` and the config also has an "
            "`optimizer` section; keep one of them (remove `optimizer` from the config, or pass optimizer=None)"
        )
    if is_optimizer_like(optimizer):
        return optimizer
    if callable(optimizer):
        built = optimizer(params)
        if not is_optimizer_like(built):
            raise TypeError(
                f"the optimizer callable returned {type(built).__name__}, which lacks "
                f"{[n for n in _REQUIRED if not hasattr(built, n)]}; it must return a torch.optim.Optimizer "
                "or an object with param_groups/step/zero_grad/state_dict/load_state_dict"
            )
        return built
    missing = [n for n in _REQUIRED if not hasattr(optimizer, n)]
    raise TypeError(
        f"optimizer of type `{type(optimizer).__name__}` is not usable: it lacks {missing}. Pass a "
        "torch.optim.Optimizer, a callable `params -> optimizer`, or an object with "
        "param_groups/step/zero_grad/state_dict/load_state_dict"
    )


class ShardwiseOptimizer(torch.optim.Optimizer):
    """Base class of the optimizers an :class:`~shardwise.Engine` exposes.

    It wraps the inner optimizer (``self.inner``) and shares its ``param_groups`` list, so learning-rate schedulers
    built on either object move the same ``lr``.  Subclasses implement :meth:`step` (which returns whether the
    update was applied) and :meth:`zero_grad`.

    It deliberately skips ``torch.optim.Optimizer.__init__``: the parameters
    it steps are owned by the inner optimizer.
    """

    def __init__(self, inner: Any) -> None:  # noqa: D107 - documented on the class
        self.inner = inner
        # Attributes torch's schedulers and hooks expect on an Optimizer (typed there).
        for hooks in ("step_pre", "step_post", "state_dict_pre", "state_dict_post", "load_state_dict_pre",
                      "load_state_dict_post"):
            setattr(self, f"_optimizer_{hooks}_hooks", OrderedDict())

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return getattr(self.inner, "state", {})

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return getattr(self.inner, "defaults", {})

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        self.inner.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
