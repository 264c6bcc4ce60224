"""`Config`: the validated top-level config, its batch-size arithmetic, and `resolve` for `initialize`; pydantic's
validation errors rewritten as shardwise problem lines (path, value, what is allowed)."""

from __future__ import annotations

import os
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, Field, PrivateAttr, ValidationError, ValidationInfo, field_validator
from torch import nn

from . import auto
from .errors import ConfigError, Note, Problems, announce, canonical, problem_line, shown_value, suggest
from .limits import MAX_ACCUMULATION, MAX_MICRO_BATCH, MAX_STEPS, MAX_TIMEOUT_S, MAX_TRAIN_BATCH, check_shape
from .policy import prepare
from .reading import read_config_file
from .sections import (
    BF16Config,
    CheckpointConfig,
    CommsConfig,
    Count,
    FP16Config,
    NotANumber,
    OffloadParamConfig,
    OptimizerConfig,
    Real,
    SchedulerConfig,
    Section,
    ZeroConfig,
    field_default,
    section_of,
)

__all__ = ["BatchSizes", "Config", "load_configs"]


@dataclass(frozen=True)
class BatchSizes:
    """Resolved batch sizes; the first two are None when the config does not determine them."""

    train_batch_size: int | None
    micro_batch_size: int | None
    gradient_accumulation_steps: int

    def as_keys(self) -> dict[str, int | None]:
        """The three config keys these sizes are."""
        return {"train_batch_size": self.train_batch_size, "train_micro_batch_size_per_gpu": self.micro_batch_size,
                "gradient_accumulation_steps": self.gradient_accumulation_steps}


class Config(Section):
    """A validated shardwise config. Build one with :meth:`load` (dict, .json/.yaml path or Config).

    DeepSpeed's keys work unchanged (see `shardwise.config.policy` for the one rule every key
    follows). `notes` lists the info lines about the config (ignored keys, aliases read, `auto`
    values settled); `pending` the `auto` values that only :meth:`resolve` can settle.
    """

    train_batch_size: Count | None = Field(default=None, ge=1, le=MAX_TRAIN_BATCH)
    train_micro_batch_size_per_gpu: Count | None = Field(default=None, ge=1, le=MAX_MICRO_BATCH)
    gradient_accumulation_steps: Count | None = Field(default=None, ge=1, le=MAX_ACCUMULATION)
    gradient_clipping: Real = Field(default=0.0, ge=0)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    comms: CommsConfig = Field(default_factory=CommsConfig)
    auto_refresh_trainable: bool = True
    #: rank 0's buffers (BatchNorm statistics) broadcast before each training forward, as DDP's default
    broadcast_buffers: bool = True
    steps_per_print: Count = Field(default=10, ge=1, le=MAX_STEPS)
    wall_clock_breakdown: bool = False
    #: torch.manual_seed's range
    seed: Count | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    dist_timeout: Real = Field(default=1800.0, gt=0, le=MAX_TIMEOUT_S)
    communication_data_type: str | None = None
    #: drop the last incomplete batch of the DataLoader `shardwise.deepspeed.initialize` builds
    dataloader_drop_last: bool = False

    _notes: tuple[Note, ...] = PrivateAttr(default=())
    _pending: dict[str, str] = PrivateAttr(default_factory=dict)
    _announced: frozenset[str] = PrivateAttr(default=frozenset())
    #: the `zero_optimization` keys the user wrote (not defaults, not `auto`s a resolve filled in)
    _zero_written: frozenset[str] = PrivateAttr(default=frozenset())

    def __init__(self, **data: Any) -> None:
        """Validate keyword settings; problems raise ConfigError (prefer :meth:`load`)."""
        self._fill(data)

    # Mark the override as pydantic's own __init__: otherwise model_validate would route every
    # validation through it and wrap our ConfigError inside a ValidationError.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    def _fill(self, data: Any, source: str | None = None, prefix: tuple[str, ...] = ()) -> None:
        """Validate `data` into this instance; every problem found (policy's and pydantic's) in one ConfigError."""
        check_shape(data, prefix, source)
        prepared = prepare(data, Config, prefix)
        problems = list(prepared.problems)
        try:
            self.__pydantic_validator__.validate_python(
                prepared.data, self_instance=self, context={"pending": prepared.pending})
        except ValidationError as exc:
            problems += problems_from(Config, exc, prefix)
        if problems:
            raise ConfigError(problems, source)
        self._notes, self._pending = tuple(prepared.notes), dict(prepared.pending)
        self._zero_written = frozenset(self.zero_optimization.model_fields_set)

    @field_validator("bf16")
    @classmethod
    def _one_half_precision(cls, value: BF16Config, info: ValidationInfo) -> BF16Config:
        # A field validator (fp16 is declared first) so the clash is reported with any other problem.
        fp16 = info.data.get("fp16")
        if value.enabled and fp16 is not None and fp16.enabled:
            clash = "`fp16.enabled` and `bf16.enabled` are both true; set one of them to false"
            raise Problems([((), "raw", clash)])
        return value

    @field_validator("communication_data_type")
    @classmethod
    def _reduce_dtype(cls, value: str | None) -> str | None:
        if value is None:
            return None
        # DeepSpeed also reads `bfp16`; torch's dtype names are accepted too
        aliases = {"bfp16": "bf16", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32"}
        return canonical(aliases.get(str(value).lower(), value), ("fp32", "fp16", "bf16"))

    def __eq__(self, other: object) -> bool:
        # Settings and pending `auto`s make a config; its info lines are only about how it was written.
        if not isinstance(other, Config):
            return NotImplemented
        return self.model_dump() == other.model_dump() and self._pending == other._pending

    __hash__ = None  # type: ignore[assignment]

    @property
    def notes(self) -> tuple[Note, ...]:
        """Info lines about this config: what was ignored and why, aliases read, `auto`s settled."""
        return self._notes

    @property
    def pending(self) -> dict[str, str]:
        """Dotted paths whose `auto` value :meth:`resolve` settles -> how."""
        return dict(self._pending)

    @classmethod
    def load(cls, source: Mapping[str, Any] | str | os.PathLike[str] | Config, *, name: str | None = None) -> Config:
        """Validate `source`: a dict, a `.json`/`.yaml`/`.yml` path, or a Config (returned as is).

        A dict follows the same rules as a file's contents; `name` (e.g. the file it came from) heads any ConfigError.
        """
        if isinstance(source, Config):
            return source
        if isinstance(source, (str, os.PathLike)):
            return cls._validate(read_config_file(Path(source)), source=str(source))
        if isinstance(source, Mapping):
            return cls._validate(dict(source), source=name)
        raise ConfigError(f"config: got {type(source).__name__}; expected a dict, a path to a "
                          "`.json`/`.yaml` file, or a `shardwise.Config`")

    @classmethod
    def _validate(cls, data: Any, source: str | None = None, prefix: tuple[str, ...] = ()) -> Config:
        config = cls.__new__(cls)
        config._fill(data, source, prefix)
        return config

    def replace(self, **changes: Any) -> Config:
        """A copy with top-level settings replaced by already valid values (sections as their models, or
        None to drop one); `auto` values pending under a dropped section go with it (a replaced section
        must keep the keys still pending). Info lines are kept."""
        unknown = sorted(set(changes) - set(type(self).model_fields))
        if unknown:
            raise ValueError(f"Config.replace: unknown setting(s) {unknown}; expected top-level keys of `Config`")
        copy = self.model_copy(update=changes)
        dropped = {key for key, value in changes.items() if value is None}
        # An `auto` the new value now gives (the dialect's `weight_decay: 0.0`) no longer waits for `resolve`.
        copy._pending = {path: how for path, how in self._pending.items()
                         if path.split(".")[0] not in dropped and not _gives(changes, path)}
        # A line about a key's old value (`gradient_clipping: auto` became 0.0) is no longer true.
        copy._notes = tuple(note for note in self._notes if _top_level_key(note.path) not in changes)
        return copy

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of every setting (defaults included, `auto` where still pending); `load` reads it back."""
        data = self.model_dump()
        for path in self._pending:
            node, key = auto.parent(data, path)
            node[key] = "auto"
        return data

    def batch_sizes(self, world_size: int) -> BatchSizes:
        """Resolve DeepSpeed's rule train = micro × accumulation × world; any two given imply the third."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size: got {world_size!r}; expected an integer >= 1")
        return _batch_sizes(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                            self.gradient_accumulation_steps, world_size)

    def resolve(
        self,
        *,
        world_size: int = 1,
        model: nn.Module | None = None,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        total_num_steps: int | None = None,
        device: str | torch.device = "cpu",
    ) -> Config:
        """A new Config with every `auto` settled and the batch sizes filled in for `world_size`.

        `shardwise.initialize` calls it with what it was given: the model (dtype, hidden size for bucket sizes), the
        optimizer and lr scheduler passed (their lr; a config section whose params are all `auto` gives way to them),
        and the device the job runs on. A trainer passes `total_num_steps` for a scheduler's `total_num_steps: auto`.
        Logs the info lines (rank 0, once per line per config).
        """
        data = self.to_dict()
        for key in ("offload_optimizer", "offload_param"):  # read again below: as written, not every default
            section = getattr(self.zero_optimization, key)
            if section is not None:
                data["zero_optimization"][key] = section.model_dump(exclude_unset=True)
        facts = auto.Facts(model, optimizer, lr_scheduler, total_num_steps)
        notes = auto.fill(data, self._pending, facts)
        notes += _check_offload(data, torch.device(device))
        notes += _stage_notes(self.zero_optimization, self._zero_written, torch.device(device))
        resolved = Config._validate(data | self.batch_sizes(world_size).as_keys())
        resolved._notes = self._notes + tuple(notes) + resolved._notes
        resolved._announced = announce(resolved._notes, self._announced)
        resolved._zero_written = self._zero_written
        return resolved


def _top_level_key(shown: str) -> str | None:
    """The top-level key a note at `shown` is about, when it is about a whole top-level key (else None)."""
    parts = shown.split(".")
    if len(parts) == 3 and parts[0] == "engines":
        parts = parts[2:]
    return parts[0] if len(parts) == 1 else None


def _gives(changes: Mapping[str, Any], path: str) -> bool:
    """Whether `changes` set a value at the dotted `path` (a field set on a section, or a key of its dict)."""
    key, *rest = path.split(".")
    node: Any = changes.get(key)
    for part in rest:
        if isinstance(node, BaseModel) and part in node.model_fields_set:
            node = getattr(node, part)
        elif isinstance(node, Mapping) and part in node:
            node = node[part]
        else:
            return False
    return node is not None


def _batch_sizes(train: int | None, micro: int | None, gas: int | None, world: int) -> BatchSizes:
    names = {"micro": f"train_micro_batch_size_per_gpu {micro}", "gas": f"gradient_accumulation_steps {gas}"}
    where = f"world_size {world}"
    if train is None:
        return BatchSizes(None if micro is None else micro * (gas or 1) * world, micro, gas or 1)
    if micro is not None and gas is not None:
        if train != micro * gas * world:
            product = f"{names['micro']} × {names['gas']} × {where} = {micro * gas * world}"
            raise ConfigError(f"train_batch_size {train} != {product}; fix one of them")
        return BatchSizes(train, micro, gas)
    # One of micro / gas is given (or neither, and gas defaults to 1): derive the other.
    key, given = ("micro", micro) if micro is not None else ("gas", gas)
    divisor, terms = (given or 1) * world, (where if given is None else f"{names[key]} × {where}")
    if train % divisor:
        raise ConfigError(f"train_batch_size {train} is not divisible by {terms} = {divisor}; fix one of them")
    if micro is not None:
        return BatchSizes(train, micro, train // divisor)
    return BatchSizes(train, train // divisor, gas or 1)


#: keys that tune only the flat buckets of stages 0-2, and only stage 3's units and gathers
_FLAT_ONLY = ("reduce_bucket_size", "reduce_scatter")
_STAGE3_ONLY = ("stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                "stage3_param_persistence_threshold")


def _stage_notes(zero: ZeroConfig, given: frozenset[str], device: torch.device) -> list[Note]:
    """An info line for each key the user wrote that the chosen stage does not use (nothing accepted silently;
    nothing said about a default, or an `auto` a resolve filled in)."""
    if zero.stage == 3:
        unused = {k: "stage 3 reduce-scatters each module's gradients as one unit" for k in _FLAT_ONLY if k in given}
    else:
        unused = {k: f"it tunes stage 3, and this is stage {zero.stage}" for k in _STAGE3_ONLY if k in given}
        if zero.stage == 0 and "reduce_scatter" in given:
            unused["reduce_scatter"] = "stage 0 all-reduces its gradients"
    offload = zero.offload_optimizer
    if "sub_group_size" in given and (offload is None or (offload.device == "cpu" and device.type == "cpu")):
        unused["sub_group_size"] = ("it tiles the optimizer step of `offload_optimizer` to `nvme`, or to `cpu` on a "
                                    "job on an accelerator, which is off")
    return [Note(f"zero_optimization.{key}", f"`zero_optimization.{key}` changes nothing here: {why}")
            for key, why in unused.items()]


def _check_offload(data: dict[str, Any], device: torch.device) -> list[Note]:
    """`offload_optimizer` acts at stages 1-3 and `offload_param` at stage 3: to `cpu` on a job on an accelerator
    (ZeRO-Offload), to `nvme` on any job; `device: cpu` on a CPU job holds
    already (the state is in host memory)."""
    zero = data["zero_optimization"]
    notes = []
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key)
        if section is None:
            continue
        path = f"zero_optimization.{key}"
        what = "optimizer state and step" if key == "offload_optimizer" else "parameters"
        if section.get("device") != "nvme" and device.type == "cpu":
            notes.append(Note(path, f"`{path}.device: cpu` holds already: this job runs on the CPU, where the "
                                    f"{what} already are"))
            notes += _no_effect_on_cpu(section, path, ("pin_memory", "ratio", "buffer_count"))
            continue
        _check_stage(zero, path, section.get("device", "cpu"))
        notes.append(Note(path, f"`{path}.device: {section.get('device', 'cpu')}`: {_offload_line(zero, key, device)} "
                                "(docs/offload.md)"))
        if device.type == "cpu":
            notes += _no_effect_on_cpu(section, path, ("pin_memory",))
    return notes


def _no_effect_on_cpu(section: dict[str, Any], path: str, keys: tuple[str, ...]) -> list[Note]:
    """A line for each of ``keys`` the section has: it tunes copies to an accelerator, and this is a CPU job."""
    return [Note(f"{path}.{key}", f"`{path}.{key}` changes nothing on a CPU job: nothing is copied to an accelerator")
            for key in keys if key in section]


def _check_stage(zero: dict[str, Any], path: str, where: str) -> None:
    """The optimizer's offload needs stage 1-3, the parameters' stage 3."""
    stage, key = zero.get("stage", 0), path.split(".")[-1]
    stages = (1, 2, 3) if key == "offload_optimizer" else (3,)
    if stage not in stages:
        why = ("stage 0 keeps no sharded optimizer state to offload" if key == "offload_optimizer"
               else "only stage 3 partitions the parameters themselves")
        wanted = "1, 2 or 3" if key == "offload_optimizer" else "3"
        raise ConfigError(f"`{path}.device: {where}` needs ZeRO stage {wanted}, and this is stage {stage} ({why}); "
                          f"set `zero_optimization.stage` to {wanted}, or remove `{path}`")


def _offload_line(zero: dict[str, Any], key: str, device: torch.device) -> str:
    """What an acting offload section does, for its info line."""
    section = zero[key]
    if key == "offload_optimizer":
        size = zero.get("sub_group_size", field_default(ZeroConfig, "sub_group_size"))
        if section.get("device") == "nvme":
            return (f"this rank's fp32 master weights and optimizer state live in files under "
                    f"{section['nvme_path']!r}, stepped {size} elements at a time")
        return (f"ZeRO-Offload: this rank's fp32 master weights, gradients and optimizer state live in host memory, "
                f"where the optimizer steps them up to {size} elements at a time while the model trains on "
                f"{device.type}")
    if section.get("device") == "nvme":
        onto = "" if device.type == "cpu" else f", copied to {device.type} as the unit is gathered"
        return (f"this rank's shard of each unit of parameters lives in a file under {section['nvme_path']!r}, at "
                f"most {section.get('max_in_cpu', field_default(OffloadParamConfig, 'max_in_cpu'))} elements of them "
                f"in host memory{onto}")
    return (f"this rank's shard of each unit of parameters lives in host memory, copied to {device.type} as the "
            "unit is gathered")


def load_configs(path: str | os.PathLike[str] | Mapping[str, Any], *, name: str | None = None) -> dict[str, Config]:
    """Load a file of named configs, `engines: {name: {...}, ...}`, validating each one.

    `path` may also be the file's contents as a dict (`name` then heads any ConfigError). Problems in
    every engine are reported together, with paths like `engines.teacher.zero_optimization.stage`.
    """
    if isinstance(path, Mapping):
        data, source = dict(path), name
    else:
        data, source = read_config_file(Path(path)), str(path)
    check_shape(data, source=source)
    engines = data.get("engines")
    extra = [str(k)[:80] for k in data if k != "engines"]
    if not isinstance(engines, dict) or not engines or extra:
        found = f"top-level keys {sorted(extra)[:10]}" if extra else "no engines"
        expected = ("expected a single top-level key `engines` mapping engine names to configs, "
                    "e.g. `engines: {student: {...}, teacher: {...}}`")
        raise ConfigError(f"{expected}; found {found}", source)
    configs: dict[str, Config] = {}
    problems: list[str] = []
    for engine, raw in engines.items():
        try:
            configs[str(engine)] = Config._validate(raw, prefix=("engines", str(engine)))
        except ConfigError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ConfigError(problems, source)
    return configs


# ------------------------------------------------------------ pydantic's errors as problem lines

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
