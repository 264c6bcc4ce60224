"""Refuse decoded checkpoint values that do not have the shape of what they replace.

Scheduler, loss-scaler, counter, param-group and RNG states come back from a
checkpoint as plain data, and each is then handed to a ``load_state_dict`` or
set on an object.  Before anything is applied, each is checked against the
live object's current state (the *template*): the same keys (or fewer), and
values of the same kinds, recursively.  A crafted checkpoint can therefore
change a number, never add an attribute, turn a number into a callable, or
swap a tensor for one of another shape.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import CheckpointError

__all__ = ["conform"]

_NUMBER = (int, float)


def _is_number(value: Any) -> bool:
    return isinstance(value, _NUMBER) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    if value is None or _is_number(value):
        return "a number or null"
    return f"a {type(value).__name__}"


def conform(loaded: Any, template: Any, where: str) -> Any:
    """``loaded`` if it has the structure of ``template``; else a :class:`CheckpointError` naming ``where``.

    An integer must stay an integer; a float or None (an optional setting) may
    be any number or None; dicts may omit keys but not add any; sequences match element by element when their
    lengths agree, else every element matches the template's first.
    """
    if isinstance(template, dict):
        return _conform_dict(loaded, template, where)
    if isinstance(template, (list, tuple)):
        return _conform_sequence(loaded, template, where)
    if isinstance(template, torch.Tensor):
        ok = isinstance(loaded, torch.Tensor) and loaded.dtype == template.dtype and loaded.shape == template.shape
        if not ok:
            got = f"{loaded.dtype} {tuple(loaded.shape)}" if isinstance(loaded, torch.Tensor) else _kind(loaded)
            _refuse(where, f"a {template.dtype} tensor of shape {tuple(template.shape)}", got)
        return loaded
    if isinstance(template, int) and not isinstance(template, bool):
        if isinstance(loaded, bool) or not isinstance(loaded, int):
            _refuse(where, "an integer", _kind(loaded))
        return loaded
    if template is None or isinstance(template, float):
        if loaded is not None and not _is_number(loaded):
            _refuse(where, "a number or null", _kind(loaded))
        return loaded
    if type(loaded) is not type(template):
        _refuse(where, _kind(template), _kind(loaded))
    return loaded


def _conform_dict(loaded: Any, template: dict[Any, Any], where: str) -> dict[Any, Any]:
    if not isinstance(loaded, dict):
        _refuse(where, "a mapping", _kind(loaded))
    unknown = [k for k in loaded if k not in template]
    if unknown:
        _refuse(where, f"only the keys {sorted(map(str, template))}", f"unknown key(s) {sorted(map(str, unknown))}")
    return {k: conform(v, template[k], f"{where}[{k!r}]") for k, v in loaded.items()}


def _conform_sequence(loaded: Any, template: Any, where: str) -> Any:
    if not isinstance(loaded, (list, tuple)):
        _refuse(where, f"a {type(template).__name__}", _kind(loaded))
    if len(loaded) == len(template):
        items = [conform(v, t, f"{where}[{i}]") for i, (v, t) in enumerate(zip(loaded, template))]
    elif template:
        items = [conform(v, template[0], f"{where}[{i}]") for i, v in enumerate(loaded)]
    else:
        items = [conform(v, None, f"{where}[{i}]") for i, v in enumerate(loaded)]
    return type(loaded)(items)


def _refuse(where: str, expected: str, got: str) -> None:
    raise CheckpointError(
        f"`{where}` in the checkpoint is {got}, but this engine's value there is {expected}; the checkpoint "
        "was damaged or crafted, or written by another program: refusing it (nothing was changed)"
    )
