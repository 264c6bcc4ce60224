"""Partitioned parameters inside ``torch.compile``d code (docs/stage3.md, "torch.compile").

Dynamo cannot trace the eager ``__torch_function__`` bookkeeping (:mod:`.params`), and must not: a graph
replays without Python.  So while Dynamo traces, an operation on a partitioned parameter goes straight to torch,
and the check runs once, at trace time (:func:`_check_read`, ``assume_constant_result``): the owner makes every
replay find the parameter gathered (stage 3 registers it as an external parameter of the running module) or
raises.  The stage 3 hooks never enter a graph (``torch._dynamo.disable``): a graph breaks at each module call.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence, TypeVar

import torch

__all__ = ["outside_graphs", "skip_frames", "track", "traced_call", "untrack"]

_F = TypeVar("_F", bound=Callable[..., Any])

#: id(parameter) -> (the parameter, its unit): how a check at trace time finds both from a constant.  Both
#: held weakly (a unit holds its engine's machinery: a dropped engine and model must be freed), and an entry
#: goes with its parameter.
_TRACKED: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[Any]]] = {}


def track(param: torch.Tensor, unit: Any) -> None:
    """``param`` is partitioned into ``unit``: a traced read of it is checked by ``unit.owner``."""
    key = id(param)

    def gone(ref: weakref.ref[torch.Tensor]) -> None:
        if _TRACKED.get(key, (None,))[0] is ref:  # not a later parameter that got the same id
            del _TRACKED[key]

    _TRACKED[key] = (weakref.ref(param, gone), weakref.ref(unit))


def untrack(param: torch.Tensor) -> None:
    """``param`` is no longer partitioned."""
    _TRACKED.pop(id(param), None)


def traced_call(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """What a partitioned parameter's ``__torch_function__`` does while Dynamo traces it.

    Every operation counts as a read, metadata too: Dynamo cannot hash ``func`` to tell them apart,
    and the check costs nothing once traced.
    """
    for value in (*args, *kwargs.values()):
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if getattr(type(item), "_shardwise_partitioned", False):
                _check_read(id(item))
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def outside_graphs(fn: _F) -> _F:
    """``fn`` always runs eagerly: a graph being traced breaks where it is called (``torch._dynamo.disable``)."""
    import torch._dynamo  # here, not at import: it costs ~0.9 s, paid by stage 3 engines only

    return torch._dynamo.disable(fn)  # type: ignore[no-any-return]


def skip_frames(fn: Callable[..., Any]) -> None:
    """Dynamo never compiles ``fn`` (nor what it calls) as a frame of its own; it still inlines ``fn``
    while tracing code that calls it.  An operation run eagerly between two graphs then takes its
    eager path, checks included, instead of being traced alone with the checks left out."""
    import torch._dynamo
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    strategy = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
    torch._dynamo.eval_frame.set_code_exec_strategy(fn.__code__, strategy)


def _check_read_now(param_id: int) -> bool:
    entry = _TRACKED.get(param_id)
    param, unit = (entry[0](), entry[1]()) if entry is not None else (None, None)
    if param is None or unit is None:
        return True
    unit.owner.on_traced_read(unit, param)
    return True


def _check_read(param_id: int) -> bool:
    """While Dynamo traces, a call of this runs :func:`_check_read_now` in Python and leaves a constant."""
    return _check_read_now(param_id)


# What `torch._dynamo.assume_constant_result` does (it only sets this), without importing Dynamo here.
_check_read._dynamo_marked_constant = True  # type: ignore[attr-defined]
