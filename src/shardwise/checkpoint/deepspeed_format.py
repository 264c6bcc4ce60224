"""A DeepSpeed checkpoint put together: full fp32 weights and full optimizer state per parameter.

DeepSpeed keeps, per param group, one flat fp32 vector split across the ranks.  At stages 1 and 2
(``single_partition_of_fp32_groups``) it holds the group's parameters one after the other, each followed by
its alignment padding (``param_alignment_paddings``), cut into ``world_size`` consecutive pieces (the last
piece's end padding is not stored).  At stage 3 (``fp32_flat_groups``) every parameter is cut into
``world_size`` equal pieces (the last padded), and a rank's vector is its piece of each parameter, over all
groups.  Per-element optimizer state (Adam's moments) is laid out like the fp32 vector; ``step`` is one
value per group.  At stage 0 the model states file holds the torch optimizer's ``state_dict`` (by index, matched
to the engine's parameters on load) and, in 16-bit, the fp32 masters (``fp32_groups``).

The files (pickles, with no checksums) and the rules they are read under are in ``docs/checkpoints.md``
("DeepSpeed checkpoints in"); a crafted file can state any shape, so each is bounded by the model (:class:`ModelShapes`).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch.serialization import safe_globals

from .files import MAX_DIMS, CheckpointError, check_records, check_views, open_regular, regular_size
from .layout import MODEL_STATES

__all__ = [
    "BYTES_PER_ELEMENT", "SLACK_BYTES", "DeepSpeedCheckpoint", "DeepSpeedFiles", "DeepSpeedParam", "ModelShapes",
    "as_size", "read_deepspeed", "read_pickle",
]

_RANKED = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_(optim|model)_states\.pt")


class DeepSpeedRecord:
    """Stand-in for a DeepSpeed object in a checkpoint (a loss scaler, a fragment address): its fields only."""

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}

    def __setstate__(self, state: Any) -> None:
        # Never ``__dict__.update``: a crafted state could not replace a method this way.
        self.fields = dict(state) if isinstance(state, dict) else {"state": state}


#: every non-torch class a DeepSpeed 0.14-0.19 checkpoint of the supported kinds stores
ALLOWED: list[Any] = [
    (DeepSpeedRecord, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DeepSpeedRecord, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (DeepSpeedRecord, "deepspeed.utils.tensor_fragment.fragment_address"),
    (int, "deepspeed.runtime.zero.config.ZeroStageEnum"),  # `ZeroStageEnum(value)` read as the plain int stage
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
            found = re.search(r"GLOBAL ([\w.]+)", str(exc)) or re.search(r"function (<[^>]+>|[\w.]+)", str(exc))
            raise CheckpointError(
                f"{path} needs `{found.group(1) if found else str(exc).splitlines()[0][:200]}` to be unpickled, which "
                f"shardwise does not load from a DeepSpeed checkpoint (it builds only tensors, plain values and "
                f"{sorted(n for _, n in ALLOWED)}): loading it could run code from the file. If you trust the file, set "
                "`checkpoint.allow_pickle: true`; otherwise drop that object from the `client_state` you saved"
            ) from None
        except (OSError, RuntimeError, EOFError, ValueError) as exc:
            raise CheckpointError(
                f"{path}: cannot read this DeepSpeed file ({type(exc).__name__}: {exc!s:.200}); DeepSpeed files "
                "carry no checksums, so a damaged or cut file shows only here: save the checkpoint again"
            ) from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a dict, as DeepSpeed saves, got a {type(value).__name__}")
    check_views(value, path)
    return value


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


#: keys DeepSpeed writes into the model states itself; every other key came from `client_state`
_DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
    "ds_version", "checkpoint_parallel_dimensions", "ds_autoep_layers", "autoep_layers",
})


@dataclass
class DeepSpeedParam:
    """One trainable parameter: full fp32 value and full optimizer state (``name`` None at stage 0 until matched)."""

    name: Optional[str]
    shape: Optional[torch.Size]
    value: Optional[torch.Tensor]
    state: dict[str, Any]


@dataclass
class DeepSpeedCheckpoint:
    """Everything shardwise restores from a DeepSpeed checkpoint, world-size independent."""

    path: Path
    stage: int
    world_size: int
    dtype: str
    groups: list[list[DeepSpeedParam]]
    hyper: list[dict[str, Any]]
    module: dict[str, torch.Tensor]
    buffer_names: list[str]
    shared: dict[str, str]
    scheduler: Optional[dict[str, Any]]
    counters: dict[str, int]
    scaler: Optional[dict[str, Any]]
    client_state: dict[str, Any] = field(default_factory=dict)
    accumulation: int = 1

    def weights(self) -> dict[str, torch.Tensor]:
        """Full fp32 ``state_dict`` as zero_to_fp32 makes it: masters where named, else the module values."""
        state = {k: (v.float() if v.is_floating_point() else v) for k, v in self.module.items() if v.numel() > 0
                 or k in self.buffer_names}
        for param in (p for group in self.groups for p in group):
            if param.name is not None and param.value is not None:
                state[param.name] = param.value
        for alias, source in self.shared.items():
            if source in state:
                state[alias] = state[source]
        return state


def read_deepspeed(path: Path, allow_pickle: bool = False, model: Optional[ModelShapes] = None) -> DeepSpeedCheckpoint:
    """Read and put together the DeepSpeed checkpoint in tag directory ``path`` (any stage, any world size),
    bounded by and checked against ``model`` when given (``consolidate`` has none: each file by its own size)."""
    files = DeepSpeedFiles(path)
    budget, over = (model.budget, model.over_budget()) if model is not None and not allow_pickle else (None, "")
    read = partial(read_pickle, allow_pickle=allow_pickle, budget=budget, over_budget=over)
    states = read(files.first_model_states)
    optim = [_optimizer_dict(read(f), f) for f in files.optim]
    config = states.get("ds_config") or {}
    dtype = "bf16" if _enabled(config, "bf16") or any(f.name.startswith("bf16_") for f in files.optim) else (
        "fp16" if _enabled(config, "fp16") else "fp32")
    module = _tensors(states.get("module") or {}, "module", files.first_model_states)
    if model is not None:
        model.check_module(module, files.first_model_states)
        if optim:
            model.check_param_shapes(_shapes(states, files.first_model_states), module, files.first_model_states)
    try:
        accumulation = config.get("gradient_accumulation_steps", 1) if isinstance(config, dict) else 1
        if not optim:
            groups, hyper, scaler = _stage0(states, module, files.first_model_states)
            stage, world = 0, int(states.get("dp_world_size") or 1)
        else:
            stage3, record = "fp32_flat_groups" in optim[0], optim[0].get("loss_scaler")
            scaler = record.fields if isinstance(record, DeepSpeedRecord) else (  # the loss scaler's fields
                record if isinstance(record, dict) else None)
            stage, world = 3 if stage3 else int(optim[0].get("zero_stage", 1)), len(optim)
            groups, hyper = (_stage3 if stage3 else _stage12)(states, optim, files)
            module.update(_frozen_stage3(files, read, states, model) if stage3 else
                          _tensors(states.get("frozen_param_fragments") or {}, "frozen_param_fragments", path))
        if model is not None:
            model.check_module(module, path)
        return DeepSpeedCheckpoint(
            path=path, stage=stage, world_size=world, dtype=dtype, groups=groups, hyper=hyper, module=module,
            buffer_names=[str(n) for n in states.get("buffer_names") or []],
            shared={str(k): str(v) for k, v in (states.get("shared_params") or {}).items()},
            scheduler=states.get("lr_scheduler") if isinstance(states.get("lr_scheduler"), dict) else None,
            counters={k: _count(states, k, files.first_model_states) for k in ("global_steps", "skipped_steps")},
            scaler=scaler,
            client_state={k: v for k, v in states.items() if k not in _DEEPSPEED_KEYS},
            accumulation=accumulation if isinstance(accumulation, int) and not isinstance(accumulation, bool)
            and accumulation > 0 else 1,
        )
    except (KeyError, IndexError, TypeError, AttributeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(
            f"{path}: the files do not hold what DeepSpeed writes ({type(exc).__name__}: {exc!s:.200}); they were "
            "damaged or edited, or are not one DeepSpeed save: load a checkpoint as DeepSpeed saved it"
        ) from None


def _optimizer_dict(states: dict[str, Any], path: Path) -> dict[str, Any]:
    value = states.get("optimizer_state_dict")
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: no `optimizer_state_dict` dict, which every DeepSpeed optimizer file has; "
                              "the file is not a DeepSpeed ZeRO optimizer file or was damaged")
    return value


def _enabled(config: Any, section: str) -> bool:
    value = config.get(section) if isinstance(config, dict) else None
    return isinstance(value, dict) and bool(value.get("enabled"))


def _tensors(values: Any, what: str, path: Path) -> dict[str, torch.Tensor]:
    if not isinstance(values, dict) or not all(isinstance(v, torch.Tensor) for v in values.values()):
        raise CheckpointError(f"{path}: `{what}` must map names to tensors; the file was damaged or is not DeepSpeed's")
    return {str(k): v for k, v in values.items()}


def _count(states: dict[str, Any], key: str, path: Path) -> int:
    value = states.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"{path}: `{key}` is {value!r}, expected a non-negative integer")
    return value


def _shapes(states: dict[str, Any], path: Path) -> list[list[tuple[str, torch.Size]]]:
    shapes = states.get("param_shapes")
    if not isinstance(shapes, list) or not all(isinstance(g, dict) for g in shapes):
        raise CheckpointError(f"{path}: `param_shapes` must be a list of dicts (one per param group), "
                              f"got {type(shapes).__name__}; the file was damaged or is not DeepSpeed's")
    return [[(str(n), as_size(s, f"param_shapes[{g}][{n!r}]", path)) for n, s in group.items()]
            for g, group in enumerate(shapes)]


def _hyper(group: Any) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"} if isinstance(group, dict) else {}


def _stage0(states: dict[str, Any], module: dict[str, torch.Tensor],
            path: Path) -> tuple[list[list[DeepSpeedParam]], list[dict[str, Any]], Optional[dict[str, Any]]]:
    saved = states.get("optimizer")
    if not isinstance(saved, dict):
        return [], [], None  # saved without optimizer state (or inference only): weights come from `module`
    wrapped = isinstance(saved.get("optimizer_state_dict"), dict)
    inner = saved["optimizer_state_dict"] if wrapped else saved
    masters = saved.get("fp32_groups") if wrapped else None
    groups, hyper = [], []
    for g, group in enumerate(inner.get("param_groups") or []):
        params = []
        for j, index in enumerate(group.get("params") or []):
            state = dict((inner.get("state") or {}).get(index) or {})
            value = masters[g][j] if masters is not None else None
            shape = value.shape if value is not None else (state["exp_avg"].shape if "exp_avg" in state else None)
            params.append(DeepSpeedParam(None, shape, value, state))
        groups.append(params)
        hyper.append(_hyper(group))
    scaler = {k: saved[k] for k in ("cur_scale", "cur_iter", "last_overflow_iter") if k in saved} if wrapped else None
    return groups, hyper, scaler


def _stage12(states: dict[str, Any], optim: list[dict[str, Any]],
             files: DeepSpeedFiles) -> tuple[list[list[DeepSpeedParam]], list[dict[str, Any]]]:
    shapes = _shapes(states, files.first_model_states)
    paddings = optim[0].get("param_alignment_paddings") or [[0] * len(g) for g in shapes]
    groups, hyper = [], []
    for g, group_shapes in enumerate(shapes):
        pieces = [o["single_partition_of_fp32_groups"][g].reshape(-1) for o in optim]
        # each rank's per-element state cut to its piece of the vector (dropping padding)
        flat_state = _joined([_base_state(o, g) for o in optim], [slice(0, p.numel()) for p in pieces])
        flat, params, offset = torch.cat(pieces), [], 0
        for (name, shape), padding in zip(group_shapes, paddings[g]):
            numel = math.prod(shape)
            if offset + numel > flat.numel():
                raise CheckpointError(f"{files.path}: the fp32 partitions hold {flat.numel()} elements, too few for "
                                      f"`{name}` at offset {offset} ({numel} elements); a rank's optimizer file is "
                                      "from another save")
            params.append(DeepSpeedParam(name, shape, flat[offset : offset + numel].view(shape).clone(),
                                         _slice_state(flat_state, offset, numel)))
            offset += numel + int(padding)
        groups.append(params)
        base = optim[0].get("base_optimizer_state")
        saved_groups = base.get("param_groups") if isinstance(base, dict) else None
        hyper.append(_hyper(saved_groups[g]) if saved_groups and g < len(saved_groups) else {})
    return groups, hyper


def _base_state(optim: dict[str, Any], group: int) -> dict[str, Any]:
    """Group ``group``'s optimizer state on one rank (DeepSpeed's elastic list, or torch's state_dict)."""
    base = optim.get("base_optimizer_state")
    if isinstance(base, list):
        state = dict(base[group])
        if "base_optimizer_state_step" in optim:
            state.setdefault("step", optim["base_optimizer_state_step"])
        return state
    if isinstance(base, dict):
        return dict((base.get("state") or {}).get(group) or {})
    return {}


def _joined(parts: list[dict[str, Any]], cuts: list[slice]) -> dict[str, Any]:
    """``parts[0]``, each per-element entry joined over ``parts`` (part i flattened and cut to ``cuts[i]``)."""
    return {k: torch.cat([p[k].reshape(-1)[cut] for p, cut in zip(parts, cuts)]) if _per_element(v) else v
            for k, v in parts[0].items()}


def _per_element(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _slice_state(state: dict[str, Any], start: int, numel: int) -> dict[str, Any]:
    return {k: (v[start : start + numel].clone() if _per_element(v) else v) for k, v in state.items()}


def _stage3(states: dict[str, Any], optim: list[dict[str, Any]],
            files: DeepSpeedFiles) -> tuple[list[list[DeepSpeedParam]], list[dict[str, Any]]]:
    shapes = _shapes(states, files.first_model_states)
    world = len(optim)
    flats = [torch.cat([t.reshape(-1) for t in o["fp32_flat_groups"]]) for o in optim]
    rank_states = [_sub_group_state(o) for o in optim]
    groups, offset = [], 0
    for group_shapes in shapes:
        params = []
        for name, shape in group_shapes:
            numel = math.prod(shape)
            part = math.ceil(numel / world)
            short = [r for r, f in enumerate(flats) if offset + part > f.numel()]
            if short:
                raise CheckpointError(f"{files.path}: rank {short[0]}'s fp32 partition has {flats[short[0]].numel()} "
                                      f"elements, too few for `{name}`; the files are not from one save")
            value = torch.cat([f[offset : offset + part] for f in flats])[:numel].view(shape).clone()
            state = _slice_state(_joined(rank_states, [slice(offset, offset + part)] * world), 0, numel)
            params.append(DeepSpeedParam(name, shape, value, state))
            offset += part
        groups.append(params)
    inner = optim[0].get("optimizer_state_dict") or {}
    saved_groups = inner.get("param_groups") or []
    hyper = [_hyper(g) for g in saved_groups] if len(saved_groups) == len(shapes) else [{} for _ in shapes]
    return groups, hyper


def _sub_group_state(optim: dict[str, Any]) -> dict[str, Any]:
    """One rank's optimizer state over all its sub-groups, per-element entries joined like ``fp32_flat_groups``."""
    inner = optim.get("optimizer_state_dict") or {}
    state = inner.get("state") or {}
    subs = [dict(state.get(i) or {}) for i in range(len(optim["fp32_flat_groups"]))]
    return _joined(subs, [slice(None)] * len(subs)) if subs else {}


def _frozen_stage3(files: DeepSpeedFiles, read: Callable[[Path], dict[str, Any]], first: dict[str, Any],
                   model: Optional[ModelShapes]) -> dict[str, torch.Tensor]:
    raw = first.get("frozen_param_shapes") or {}
    if not isinstance(raw, dict):
        raise CheckpointError(f"{files.first_model_states}: `frozen_param_shapes` must map names to shapes, got "
                              f"{type(raw).__name__}; the file was damaged or is not DeepSpeed's")
    shapes = (model.check_frozen(raw, files.first_model_states) if model is not None else
              {str(n): as_size(s, f"frozen_param_shapes[{n!r}]", files.first_model_states) for n, s in raw.items()})
    if not shapes:
        return {}
    fragments = [_tensors(read(f).get("frozen_param_fragments") or {}, "frozen_param_fragments", f)
                 for f in files.rank_models]
    found = {}
    for name, shape in shapes.items():
        pieces = [f.get(name) for f in fragments]
        held = sum(p.numel() for p in pieces if p is not None)
        if any(p is None for p in pieces) or held < math.prod(shape):
            raise CheckpointError(f"{files.path}: the ranks' `frozen_param_fragments` hold {held:,} elements of "
                                  f"`{name}`, which is {tuple(shape)}; a rank's file is from another save")
        found[name] = torch.cat([p.reshape(-1) for p in pieces if p is not None])[: math.prod(shape)].view(shape)
    return found
