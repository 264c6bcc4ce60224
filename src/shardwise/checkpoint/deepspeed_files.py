"""Unpickling the files of a DeepSpeed checkpoint, allowing only the classes DeepSpeed stores.

DeepSpeed writes ``torch.save`` pickles (0.14-0.19: ``TAG/mp_rank_00_model_states.pt`` at stages 0-2, one
``zero_pp_rank_R_mp_rank_00_model_states.pt`` per rank at stage 3, and at stages 1-3 one
``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` per rank).  They are read with
``torch.load(weights_only=True)`` plus the few DeepSpeed classes below, each a stand-in that only records its
fields (nothing of DeepSpeed is imported or run); a file that needs another class is refused, naming it.  They
carry no checksums: a damaged file shows only in the unpickler and in the shape checks.  A crafted file can
state any shape, so loading into an engine, every file is bounded by the model (:class:`ModelShapes`: at most
:data:`BYTES_PER_ELEMENT` per element, plus :data:`SLACK_BYTES`) and every shape it states is compared with
the model's before any value is put together.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch.serialization import safe_globals

from .files import MAX_DIMS, CheckpointError, check_records, check_views, open_regular, regular_size
from .layout import MODEL_STATES

__all__ = ["BYTES_PER_ELEMENT", "SLACK_BYTES", "DeepSpeedFiles", "ModelShapes", "as_size", "read_pickle"]

_RANKED = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_(optim|model)_states\.pt")


class DeepSpeedRecord:
    """Stand-in for a DeepSpeed object in a checkpoint (a loss scaler, a fragment address): its fields only."""

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}

    def __setstate__(self, state: Any) -> None:
        # Never ``__dict__.update``: a crafted state could not replace a method this way.
        self.fields = dict(state) if isinstance(state, dict) else {"state": state}


def _zero_stage(value: int) -> int:
    """Stand-in for ``ZeroStageEnum(value)``: the stage as a plain int."""
    return int(value)


#: every non-torch class a DeepSpeed 0.14-0.19 checkpoint of the supported kinds stores
ALLOWED: list[Any] = [
    (DeepSpeedRecord, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DeepSpeedRecord, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (DeepSpeedRecord, "deepspeed.utils.tensor_fragment.fragment_address"),
    (_zero_stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
]


def read_pickle(path: Path, allow_pickle: bool = False, budget: Optional[int] = None,
                over_budget: str = "") -> dict[str, Any]:
    """One DeepSpeed file as a dict, read as untrusted input (:func:`~.files.check_records`, ``budget`` and its
    ``over_budget`` message included); refused if it needs a class outside :data:`ALLOWED` unless ``allow_pickle``."""
    with open_regular(path) as stream:
        check_records(stream, path, budget, over_budget)
        try:
            with safe_globals(ALLOWED):
                value = torch.load(stream, map_location="cpu", weights_only=not allow_pickle)
        except torch.serialization.pickle.UnpicklingError as exc:
            raise CheckpointError(_refusal(path, str(exc))) from None
        except (OSError, RuntimeError, EOFError, ValueError) as exc:
            raise CheckpointError(
                f"{path}: cannot read this DeepSpeed file ({type(exc).__name__}: {exc!s:.200}); DeepSpeed files "
                "carry no checksums, so a damaged or cut file shows only here: save the checkpoint again"
            ) from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a dict, as DeepSpeed saves, got a {type(value).__name__}")
    check_views(value, path)
    return value


def _refusal(path: Path, detail: str) -> str:
    found = re.search(r"GLOBAL ([\w.]+)", detail) or re.search(r"function (<[^>]+>|[\w.]+)", detail)
    name = found.group(1) if found else detail.splitlines()[0][:200]
    return (
        f"{path} needs `{name}` to be unpickled, which shardwise does not load from a DeepSpeed checkpoint (it "
        f"builds only tensors, plain values and {sorted(n for _, n in ALLOWED)}): loading it could run code from "
        "the file. If you trust the file, set `checkpoint.allow_pickle: true`; otherwise drop that object from "
        "the `client_state` you saved"
    )


class DeepSpeedFiles:
    """The files of one DeepSpeed checkpoint (one tag directory), by kind and rank."""

    def __init__(self, path: Path) -> None:
        self.path = path
        names = {n for n in os.listdir(path) if n == MODEL_STATES or _RANKED.fullmatch(n)}
        for name in names:
            regular_size(path / name)  # a link planted in a file's place is refused, never read through
        self.model_states = path / MODEL_STATES if MODEL_STATES in names else None
        self.rank_models = self._ranked(names, "model")
        self.optim = self._ranked(names, "optim")

    def _ranked(self, names: set[str], kind: str) -> list[Path]:
        found: dict[int, str] = {}
        for name in names:
            match = _RANKED.fullmatch(name)
            if match and match.group(3) == kind:
                found[int(match.group(2))] = name
        if found and sorted(found) != list(range(len(found))):
            raise CheckpointError(
                f"{self.path}: the DeepSpeed {kind} files are for ranks {sorted(found)}, expected 0..{len(found) - 1}; "
                "a rank's file is missing (a save that did not finish?): load another checkpoint"
            )
        return [self.path / found[r] for r in range(len(found))]

    @property
    def first_model_states(self) -> Path:
        """The model states every stage has: ``mp_rank_00_...`` (stages 0-2) or rank 0's (stage 3)."""
        if self.model_states is not None:
            return self.model_states
        if self.rank_models:
            return self.rank_models[0]
        raise CheckpointError(
            f"{self.path} holds no DeepSpeed model states (`{MODEL_STATES}` or `zero_pp_rank_0_mp_rank_00_model_states.pt`); "
            "pass the directory `save_checkpoint` wrote (with `latest`) or one tag directory in it"
        )


# ------------------------------------------------------------ the model it is loaded into

#: per element of the model a DeepSpeed file holds at most the module value (8 bytes for an int64 buffer), the fp32
#: master (4) and the optimizer's fp32 state (Adam: 2 x 4; a few optimizers keep a third): 32 leaves room for all
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
