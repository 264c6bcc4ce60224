"""What a DeepSpeed checkpoint may hold for the model it is loaded into: sizes and shapes, checked on read.

A DeepSpeed file states its own shapes (``param_shapes``, the tensors of
``module``), and a crafted one can state anything.  Loading into an engine,
shardwise knows the model, so every file is bounded by it before it is read
(its records at most :data:`BYTES_PER_ELEMENT` per element of the model, plus
:data:`SLACK_BYTES`), and every shape the file states is compared with the
model's before any value is put together: a mismatch names the parameter,
both shapes, and which of the file's own fields disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError
from .limits import MAX_DIMS

__all__ = ["BYTES_PER_ELEMENT", "SLACK_BYTES", "ModelShapes", "as_size"]

#: a DeepSpeed file holds per element of the model at most: the module value (8 bytes for an int64 buffer),
#: the fp32 master (4) and the optimizer's fp32 state (Adam: 2 x 4; a few optimizers keep a third);
#: 32 leaves room for all of it
BYTES_PER_ELEMENT = 32
#: the pickle itself, counters, the scheduler, a `client_state` of small values
SLACK_BYTES = 16 * 2**20


@dataclass(frozen=True)
class ModelShapes:
    """The full shape of every ``state_dict`` entry of the model a checkpoint is loaded into."""

    shapes: dict[str, torch.Size]

    @property
    def budget(self) -> int:
        """The most bytes of records one DeepSpeed file of this model can hold."""
        return BYTES_PER_ELEMENT * sum(math.prod(s) for s in self.shapes.values()) + SLACK_BYTES

    def over_budget(self) -> str:
        """The end of the error for a file over :attr:`budget`: what the budget is, and the fix."""
        elements = sum(math.prod(s) for s in self.shapes.values())
        return (f"the {self.budget:,} a DeepSpeed file of this model can need ({BYTES_PER_ELEMENT} bytes for each of "
                f"its {elements:,} elements, plus {SLACK_BYTES // 2**20} MiB); it was crafted, or saved from another "
                "model: load it into the model it was saved from, or, if you trust the file (its `client_state` "
                "holds large tensors), set `checkpoint.allow_pickle: true`")

    def check_module(self, module: dict[str, torch.Tensor], path: Path) -> None:
        """Every non-empty ``module`` entry this model has must have its shape (stage 3 saves empty ones)."""
        for name, value in module.items():
            want = self.shapes.get(name)
            if want is not None and value.numel() > 0 and value.shape != want:
                raise CheckpointError(
                    f"{path}: `{name}` is {tuple(value.shape)} in the DeepSpeed checkpoint's `module` and "
                    f"{tuple(want)} in this model; build the model the checkpoint was saved from"
                )

    def check_param_shapes(self, groups: list[list[tuple[str, torch.Size]]], module: dict[str, torch.Tensor],
                           path: Path) -> None:
        """``param_shapes`` (how DeepSpeed cut its flat partitions) must agree with this model."""
        for group in groups:
            for name, shape in group:
                want = self.shapes.get(name)
                if want is None or shape == want:
                    continue
                saved = module.get(name)
                own = (f"; the same file's `module` has it as {tuple(saved.shape)}, so `param_shapes` was edited or "
                       "damaged: load the checkpoint as DeepSpeed saved it" if saved is not None and saved.shape == want
                       else "; build the model the checkpoint was saved from")
                raise CheckpointError(
                    f"{path}: `param_shapes` gives `{name}` as {tuple(shape)}, and this model has {tuple(want)}{own}"
                )

    def check_frozen(self, shapes: dict[Any, Any], path: Path) -> dict[str, torch.Size]:
        """Stage 3's ``frozen_param_shapes``, as sizes, each this model's."""
        found = {str(n): as_size(s, f"frozen_param_shapes[{n!r}]", path) for n, s in shapes.items()}
        for name, shape in found.items():
            want = self.shapes.get(name)
            if want is not None and shape != want:
                raise CheckpointError(f"{path}: `frozen_param_shapes` gives `{name}` as {tuple(shape)}, and this "
                                      f"model has {tuple(want)}; build the model the checkpoint was saved from")
        return found


def as_size(value: Any, where: str, path: Path) -> torch.Size:
    """A shape the file states, as a ``torch.Size``: a sequence of at most MAX_DIMS non-negative integers."""
    if isinstance(value, (list, tuple)) and len(value) <= MAX_DIMS and all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        return torch.Size(value)
    raise CheckpointError(f"{path}: `{where}` is {value!r:.80}, expected a shape (at most {MAX_DIMS} non-negative "
                          "integers); the file was damaged or is not DeepSpeed's")
