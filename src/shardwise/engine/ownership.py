"""Which engine a parameter belongs to: one parameter, one engine.

Two engines that both hold one parameter would each reduce its gradient and each step it.  Each engine marks its
parameters with a weak reference to itself at ``initialize`` (on the parameter object, not in a process-wide table)
and unmarks them at ``destroy()``; a second engine finding a live mark refuses the module, naming both engines.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Optional

import torch

__all__ = ["claim", "owner_label", "release"]

_ATTR = "_shardwise_engine"


class _Mark:
    """A weak reference to the owning engine that copies and pickles as no owner at all.

    A copy of a parameter (``copy.deepcopy(model)``, ``torch.save(model)``) is not trained by the
    engine, and a bare weak reference could be neither pickled nor deep-copied.
    """

    __slots__ = ("ref",)

    def __init__(self, engine: Any = None) -> None:
        self.ref = weakref.ref(engine) if engine is not None else None

    def __call__(self) -> Optional[Any]:
        return self.ref() if self.ref is not None else None

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_Mark, ())

    def __deepcopy__(self, memo: dict[int, Any]) -> "_Mark":
        return _Mark()


def _owner(tensor: torch.Tensor) -> Optional[Any]:
    mark = tensor.__dict__.get(_ATTR)
    return mark() if mark is not None else None


def owner_label(tensor: Any) -> Optional[str]:
    """How messages name the engine that holds ``tensor`` (None: no engine does)."""
    owner = _owner(tensor) if isinstance(tensor, torch.Tensor) else None
    return getattr(owner, "label", None) if owner is not None else None


def claim(named: Iterable[tuple[str, torch.Tensor]], engine: Any, rank: int) -> None:
    """Mark every parameter as ``engine``'s; raises naming both engines if one is another's."""
    named = list(named)
    for name, param in named:
        other = _owner(param)
        if other is not None and other is not engine:
            raise ValueError(
                f"rank {rank}: parameter `{name}` already belongs to {other.label}, and one parameter can be "
                f"trained by only one engine (building {engine.label}); give each engine its own module, "
                "or call `destroy()` on the other engine first"
            )
    for _, param in named:
        param.__dict__[_ATTR] = _Mark(engine)


def release(params: Iterable[torch.Tensor], engine: Any) -> None:
    """Remove ``engine``'s marks (``destroy()``)."""
    for param in params:
        if _owner(param) is engine:
            del param.__dict__[_ATTR]
