"""Number fields that take numbers only: no booleans, no strings, nothing infinite, no fractions for counts.

pydantic's lax mode reads `true` as 1 and `"2"` as 2, so `stage: true` became stage 1 and
`train_micro_batch_size_per_gpu: true` a batch of 1 without a word. Its strict mode refuses `2e8` for
an integer, which every DeepSpeed config writes for bucket sizes. These types sit between the two:

* `Count`: an int, or a float with no fractional part (`2e8`); never a bool or a string;
* `Real`: an int or a finite float; never a bool or a string.

Strings that hold a number never reach them: `policy.prepare` reads those as numbers first, with an
info line (see `policy.coerce`). Ranges are set per field with `Field(ge=..., le=...)`.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BeforeValidator

__all__ = ["Count", "NotANumber", "Real"]


class NotANumber(ValueError):
    """A value of the wrong kind for a number field; `describe` adds the field's range to the message."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def _kind_problem(value: Any) -> str | None:
    if isinstance(value, bool):
        return f"`{str(value).lower()}` is a boolean, not a number; write the number"
    if isinstance(value, str):
        return "a string that is not a number; write the number without quotes"
    if not isinstance(value, (int, float)):
        return f"a {type(value).__name__}, not a number"
    if isinstance(value, float) and not math.isfinite(value):
        return "not finite; write a finite value"
    return None


def _count(value: Any) -> Any:
    problem = _kind_problem(value)
    if problem is not None:
        raise NotANumber(problem)
    if isinstance(value, float):
        if not value.is_integer():
            raise NotANumber("it has a fractional part; write a whole number")
        return int(value)
    return value


def _real(value: Any) -> Any:
    problem = _kind_problem(value)
    if problem is not None:
        raise NotANumber(problem)
    return value


Count = Annotated[int, BeforeValidator(_count)]
Real = Annotated[float, BeforeValidator(_real)]
