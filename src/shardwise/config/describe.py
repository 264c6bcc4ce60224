"""pydantic's validation errors, rewritten as shardwise problem lines (path, value, what is allowed)."""

from __future__ import annotations

import typing
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from .errors import Problems, problem_line, shown_value, suggest
from .sections import NotANumber, section_of

__all__ = ["problems_from"]

_BOUND_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")
_SYMBOLS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
#: a range whose upper end is at most this is shown whole (`0..3`); else only the bound broken
_SHOW_BOTH = 2**20


def _model_at(root: type[BaseModel], loc: Sequence[str]) -> type[BaseModel] | None:
    """The section model that a key path inside a config points into (None past a free-form dict)."""
    model: type[BaseModel] = root
    for part in loc:
        field = model.model_fields.get(part)
        sub = section_of(field.annotation) if field is not None else None
        if sub is None:
            return None
        model = sub
    return model


def _allowed_range(root: type[BaseModel], loc: Sequence[str], ctx: Mapping[str, Any]) -> str:
    """Render a numeric field's full range (both bounds), falling back to the one bound pydantic names."""
    owner = _model_at(root, loc[:-1]) if loc else None
    field = owner.model_fields.get(loc[-1]) if owner else None
    metadata = field.metadata if field else []
    bounds = {k: getattr(m, k) for m in metadata for k in _SYMBOLS if getattr(m, k, None) is not None}
    if ctx and not ("ge" in bounds and "le" in bounds and bounds["le"] <= _SHOW_BOTH):
        bounds = dict(ctx)  # the bound the value broke; a huge other bound says nothing here
    noun = "an integer" if field is not None and _holds_int(field.annotation) else "a number"
    if "ge" in bounds and "le" in bounds:
        return f"{noun} in {bounds['ge']}..{bounds['le']}"
    return " ".join([noun, " and ".join(f"{_SYMBOLS[k]} {v}" for k, v in bounds.items() if k in _SYMBOLS)]).strip()


def _holds_int(annotation: Any) -> bool:
    """Whether a field annotation is an integer (`int`, `Count`, either `| None`)."""
    return annotation is int or any(_holds_int(arg) for arg in typing.get_args(annotation))


def _describe(root: type[BaseModel], err: Mapping[str, Any], loc: tuple[str, ...], prefix: tuple[str, ...]) -> list[str]:
    """Turn one pydantic error into problem lines."""
    path = ".".join(prefix + loc)
    kind = err["type"]
    cause = (err.get("ctx") or {}).get("error")
    if kind == "extra_forbidden":
        owner = _model_at(root, loc[:-1])
        return [problem_line(path, "unknown", suggest(loc[-1], owner.model_fields if owner else ()))]
    if isinstance(cause, Problems):
        return [problem_line(".".join(prefix + loc + rel), k, detail) for rel, k, detail in cause.items]
    if kind == "missing":
        return [problem_line(path, "missing", "")]
    got = f"got {shown_value(err['input'])}"
    if isinstance(cause, NotANumber):
        return [f"`{path}`: {got}; expected {_allowed_range(root, loc, {})}: {cause}"]
    if kind in _BOUND_ERRORS:
        limit = max((v for v in (err.get("ctx") or {}).values() if isinstance(v, (int, float))), default=0)
        upper = " (shardwise's bound, far above any real setting)" if kind.startswith("less") and limit > 64 else ""
        return [f"`{path}`: {got}; expected {_allowed_range(root, loc, err.get('ctx') or {})}{upper}"]
    if kind in ("model_type", "dict_type"):
        return [f"`{path or 'config'}`: {got}; expected a mapping of settings"]
    detail = str(cause) if cause is not None else err["msg"][:1].lower() + err["msg"][1:]
    return [f"`{path}`: {got}; {detail}"]


def problems_from(root: type[BaseModel], exc: ValidationError, prefix: tuple[str, ...] = ()) -> list[str]:
    """Every problem in `exc` (raised validating `root`) as a line, paths under `prefix`."""
    lines: list[str] = []
    for err in exc.errors(include_url=False):
        lines.extend(_describe(root, err, tuple(str(p) for p in err["loc"]), prefix))
    return lines
