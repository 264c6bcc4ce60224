"""Validated shardwise configuration: DeepSpeed-compatible keys, batch-size arithmetic, named configs.

Keys follow DeepSpeed's JSON where the concept is the same, so an existing DeepSpeed config works
unchanged for the features shardwise has. Every invalid config raises :class:`ConfigError`, whose
message lists each problem on its own line with the dotted key path, the bad value and what is
allowed. Unknown keys are always errors (with the closest known key); DeepSpeed keys for features
shardwise lacks get their own message instead of "unknown key".

Defaults follow plain PyTorch: `gradient_clipping` is 0 (off) when absent, whereas recent DeepSpeed
clips at 1.0 by default.
"""

from __future__ import annotations

import difflib
import inspect
import json
import os
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import yaml
from pydantic import (
    BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator,
)

from shardwise import schedulers as _schedulers

__all__ = [
    "BF16Config", "BatchSizes", "CheckpointConfig", "Config", "ConfigError", "FP16Config",
    "OptimizerConfig", "SchedulerConfig", "ZeroConfig", "load_configs",
]


class ConfigError(ValueError):
    """An invalid config. `problems` holds one line per problem; the message lists all of them."""

    def __init__(self, problems: str | Sequence[str], source: str | None = None) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        count = len(self.problems)
        where = f" in {source}" if source else ""
        head = f"invalid shardwise config{where} ({count} problem{'' if count == 1 else 's'}):"
        super().__init__("\n".join([head, *(f"  - {line}" for line in self.problems)]))

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuild from the parts, not the formatted message, so errors survive pickling across ranks.
        return (type(self), (self.problems, self.source))


# A problem found inside a section: (path relative to the section, kind, detail).
# kind: "unknown" (unknown key), "missing" (required key absent), "value" (bad value), "raw" (as is).
_Item = tuple[tuple[str, ...], str, str]


class _Problems(ValueError):
    """Several problems found by one validator; pydantic keeps the exception, and we expand it."""

    def __init__(self, items: list[_Item]) -> None:
        super().__init__("; ".join(detail for _, _, detail in items))
        self.items = items


def _line(path: str, kind: str, detail: str) -> str:
    if kind == "unknown":
        return f"unknown key `{path}`; {detail}"
    if kind == "missing":
        return f"`{path}` is required{detail}"
    return detail if kind == "raw" else f"`{path}`: {detail}"


def _suggest(key: Any, known: Iterable[str]) -> str:
    """`did you mean X?` for the closest known key, else the list of known keys."""
    known = list(known)
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    if close:
        return f"did you mean `{close[0]}`?"
    return "remove it (known keys: " + ", ".join(f"`{k}`" for k in known) + ")"


def _canonical(value: Any, names: Iterable[str]) -> str:
    """Match `value` case-insensitively against `names` and return the canonical spelling."""
    by_lower = {n.lower(): n for n in names}
    found = by_lower.get(str(value).lower())
    if found is None:
        allowed = ", ".join(f"`{n}`" for n in by_lower.values())
        close = difflib.get_close_matches(str(value).lower(), list(by_lower), n=1, cutoff=0.6)
        hint = f"; did you mean `{by_lower[close[0]]}`?" if close else ""
        raise ValueError(f"expected one of {allowed} (any case){hint}")
    return found


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # DeepSpeed keys for features shardwise does not implement: a clearer error than "unknown key".
    unsupported_keys: ClassVar[frozenset[str]] = frozenset()


_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD,
}
_ADAM_EXTRAS = ("adam_w_mode", "torch_adam")
# name -> (lower bound, bound allowed): the torch arguments whose range we can check up front.
_OPTIMIZER_BOUNDS = {"lr": (0, True), "eps": (0, False), "weight_decay": (0, True), "momentum": (0, True)}


def _optimizer_value_problem(key: str, value: Any) -> str | None:
    if key in _ADAM_EXTRAS:
        return None if isinstance(value, bool) else "expected true or false"
    if key == "betas":
        ok = isinstance(value, (list, tuple)) and len(value) == 2
        ok = ok and all(_is_number(b) and 0 <= b < 1 for b in value)
        return None if ok else "expected two numbers in [0, 1), e.g. `[0.9, 0.999]`"
    if key in _OPTIMIZER_BOUNDS:
        low, inclusive = _OPTIMIZER_BOUNDS[key]
        ok = _is_number(value) and (value >= low if inclusive else value > low)
        return None if ok else f"expected a number {'>=' if inclusive else '>'} {low}"
    return None


class OptimizerConfig(_Section):
    """`optimizer`: a torch optimizer by DeepSpeed name (`Adam`, `AdamW`, `SGD`) and its arguments.

    `params` are torch's keyword arguments, plus DeepSpeed's Adam extras `adam_w_mode` (default
    true, as in DeepSpeed: `Adam` then means decoupled weight decay, i.e. AdamW) and `torch_adam`
    (accepted; shardwise always uses torch's implementation); `shardwise.optim` maps them.
    """

    type: str
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("type")
    @classmethod
    def _canonical_type(cls, value: str) -> str:
        return _canonical(value, _OPTIMIZERS)

    @model_validator(mode="after")
    def _check_params(self) -> OptimizerConfig:
        torch_cls = _OPTIMIZERS[self.type]
        known = [n for n in inspect.signature(torch_cls).parameters if n != "params"]
        if self.type != "SGD":
            known += _ADAM_EXTRAS
        items: list[_Item] = []
        for key, value in self.params.items():
            path = ("params", str(key))
            if key not in known:
                where = f"(not an argument of torch.optim.{torch_cls.__name__})"
                items.append((path, "unknown", f"{_suggest(key, known)} {where}"))
            elif (problem := _optimizer_value_problem(key, value)) is not None:
                items.append((path, "value", f"got {value!r}; {problem}"))
        if items:
            raise _Problems(items)
        return self


# Integer scheduler arguments; JSON writers sometimes give them as 1e5, which we accept when whole.
_SCHEDULER_INT_KEYS = ("warmup_num_steps", "total_num_steps", "last_batch_iteration")


class SchedulerConfig(_Section):
    """`scheduler`: one of DeepSpeed's `WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR` and its params."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("type")
    @classmethod
    def _canonical_type(cls, value: str) -> str:
        return _canonical(value, _schedulers.SCHEDULERS)

    @model_validator(mode="after")
    def _check_params(self) -> SchedulerConfig:
        signature = inspect.signature(_schedulers.SCHEDULERS[self.type]).parameters
        known = {n: p.default for n, p in signature.items() if n != "optimizer"}
        items: list[_Item] = []
        for key in self.params:
            if key not in known:
                items.append((("params", str(key)), "unknown", _suggest(key, known)))
        for name, default in known.items():
            if default is inspect.Parameter.empty and name not in self.params:
                fix = f" for {self.type}; set it to the total number of optimizer steps"
                items.append((("params", name), "missing", fix))
        for key in _SCHEDULER_INT_KEYS:
            value = self.params.get(key)
            if isinstance(value, float) and value.is_integer():
                self.params[key] = int(value)
        given = {k: v for k, v in self.params.items() if k in known}
        merged = {k: v for k, v in known.items() if v is not inspect.Parameter.empty} | given
        for name, problem in _schedulers.param_problems(merged):
            items.append((("params", name), "value", problem))
        if items:
            raise _Problems(items)
        return self


class FP16Config(_Section):
    """`fp16`: float16 mixed precision with loss scaling (`loss_scale` 0 means dynamic scaling)."""

    unsupported_keys: ClassVar[frozenset[str]] = frozenset({"fp16_master_weights_and_grads"})
    enabled: bool = False
    loss_scale: float = Field(0.0, ge=0)
    initial_scale_power: int = Field(16, ge=0, le=64)
    loss_scale_window: int = Field(1000, ge=1)
    hysteresis: int = Field(2, ge=1)
    min_loss_scale: float = Field(1.0, gt=0)
    consecutive_hysteresis: bool = False
    auto_cast: bool = False


class BF16Config(_Section):
    """`bf16`: bfloat16 mixed precision (no loss scaling needed)."""

    enabled: bool = False


class ZeroConfig(_Section):
    """`zero_optimization`: ZeRO stage (0 replicate, 1 shard optimizer state, 2 + gradients, 3 + params).

    Bucket sizes count elements, as in DeepSpeed. `allgather_partitions` is accepted for DeepSpeed
    compatibility; shardwise always all-gathers updated partitions.
    """

    unsupported_keys: ClassVar[frozenset[str]] = frozenset({
        "offload_optimizer", "offload_param", "sub_group_size", "round_robin_gradients",
        "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients",
        "mics_shard_size", "elastic_checkpoint", "cpu_offload", "load_from_fp32_weights",
        "ignore_unused_parameters", "legacy_stage1",
    })
    stage: int = Field(0, ge=0, le=3)
    reduce_bucket_size: int = Field(5_000_000, gt=0)
    allgather_bucket_size: int = Field(5_000_000, gt=0)
    allgather_partitions: bool = True
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    stage3_prefetch_bucket_size: int = Field(5_000_000, ge=0)
    stage3_max_live_parameters: int = Field(1_000_000_000, ge=0)
    stage3_max_reuse_distance: int = Field(1_000_000_000, ge=0)
    stage3_param_persistence_threshold: int = Field(10_000, ge=0)
    stage3_gather_16bit_weights_on_model_save: bool = False


class CheckpointConfig(_Section):
    """`checkpoint`: collective save/load behaviour (`timeout` in seconds for ranks to agree)."""

    unsupported_keys: ClassVar[frozenset[str]] = frozenset(
        {"load_universal", "use_node_local_storage", "parallel_write"})
    timeout: float = Field(300.0, gt=0)
    save_rng_state: bool = True
    allow_pickle: bool = False
    tag_validation: str = "Warn"
    async_save: bool = False

    @field_validator("tag_validation")
    @classmethod
    def _canonical_tag_validation(cls, value: str) -> str:
        return _canonical(value, ("Ignore", "Warn", "Fail"))


@dataclass(frozen=True)
class BatchSizes:
    """Resolved batch sizes; the first two are None when the config does not determine them."""

    train_batch_size: int | None
    micro_batch_size: int | None
    gradient_accumulation_steps: int


class Config(_Section):
    """A validated shardwise config. Build one with :meth:`load` (dict, .json/.yaml path or Config)."""

    unsupported_keys: ClassVar[frozenset[str]] = frozenset({
        "amp", "activation_checkpointing", "flops_profiler", "tensorboard", "wandb", "csv_monitor",
        "comms_logger", "elasticity", "aio", "sparse_attention", "data_efficiency",
        "compression_training", "autotuning", "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer", "memory_breakdown", "dump_state", "sparse_gradients",
    })
    train_batch_size: int | None = Field(None, ge=1)
    train_micro_batch_size_per_gpu: int | None = Field(None, ge=1)
    gradient_accumulation_steps: int | None = Field(None, ge=1)
    gradient_clipping: float = Field(0.0, ge=0)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    auto_refresh_trainable: bool = True
    steps_per_print: int = Field(10, ge=1)
    wall_clock_breakdown: bool = False
    seed: int | None = None
    dist_timeout: float = Field(1800.0, gt=0)
    communication_data_type: str | None = None
    prescale_gradients: bool = False
    gradient_predivide_factor: float = Field(1.0, gt=0)

    def __init__(self, **data: Any) -> None:
        """Validate keyword settings; problems raise ConfigError (prefer :meth:`load`)."""
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(_problems_from(exc)) from None

    # Mark the override as pydantic's own __init__: otherwise model_validate would route every
    # validation through it and wrap our ConfigError inside a ValidationError.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @field_validator("bf16")
    @classmethod
    def _one_half_precision(cls, value: BF16Config, info: ValidationInfo) -> BF16Config:
        # A field validator (fp16 is declared first) so the clash is reported with any other problem.
        fp16 = info.data.get("fp16")
        if value.enabled and fp16 is not None and fp16.enabled:
            clash = "`fp16.enabled` and `bf16.enabled` are both true; set one of them to false"
            raise _Problems([((), "raw", clash)])
        return value

    @field_validator("communication_data_type")
    @classmethod
    def _canonical_comm_dtype(cls, value: str | None) -> str | None:
        return None if value is None else _canonical(value, ("fp32", "fp16", "bf16"))

    @classmethod
    def load(cls, source: Mapping[str, Any] | str | os.PathLike[str] | Config) -> Config:
        """Validate `source`: a dict, a `.json`/`.yaml`/`.yml` path, or a Config (returned as is)."""
        if isinstance(source, Config):
            return source
        if isinstance(source, (str, os.PathLike)):
            return cls._validate(_read(Path(source)), source=str(source))
        if isinstance(source, Mapping):
            return cls._validate(dict(source))
        raise ConfigError(f"config: got {type(source).__name__}; expected a dict, a path to a "
                          "`.json`/`.yaml` file, or a `shardwise.Config`")

    @classmethod
    def _validate(cls, data: Any, source: str | None = None, prefix: tuple[str, ...] = ()) -> Config:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(_problems_from(exc, prefix), source) from None

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of every setting (defaults included); `Config.load` accepts it back."""
        return self.model_dump()

    def batch_sizes(self, world_size: int) -> BatchSizes:
        """Resolve DeepSpeed's rule train = micro × accumulation × world; any two given imply the third."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size: got {world_size!r}; expected an integer >= 1")
        train, micro = self.train_batch_size, self.train_micro_batch_size_per_gpu
        gas = self.gradient_accumulation_steps
        names = {"micro": f"train_micro_batch_size_per_gpu {micro}", "gas": f"gradient_accumulation_steps {gas}"}
        world = f"world_size {world_size}"
        if train is not None and micro is not None and gas is not None:
            if train != micro * gas * world_size:
                product = f"{names['micro']} × {names['gas']} × {world} = {micro * gas * world_size}"
                raise ConfigError(f"train_batch_size {train} != {product}; fix one of them")
            return BatchSizes(train, micro, gas)
        if train is not None:
            # One of micro / gas is given (or neither, and gas defaults to 1): derive the other.
            if micro is not None:
                divisor, terms = micro * world_size, f"{names['micro']} × {world}"
            elif gas is not None:
                divisor, terms = gas * world_size, f"{names['gas']} × {world}"
            else:
                divisor, terms = world_size, world
            if train % divisor:
                raise ConfigError(
                    f"train_batch_size {train} is not divisible by {terms} = {divisor}; fix one of them")
            if micro is not None:
                return BatchSizes(train, micro, train // divisor)
            return BatchSizes(train, train // divisor, gas or 1)
        if micro is not None:
            return BatchSizes(micro * (gas or 1) * world_size, micro, gas or 1)
        return BatchSizes(None, None, gas or 1)


def _read(path: Path) -> dict[str, Any]:
    """Parse a .json/.yaml/.yml file whose top level must be a mapping."""
    suffix = path.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise ConfigError(
            f"config file `{path}`: unsupported suffix {suffix!r}; expected `.json`, `.yaml` or `.yml`")
    if not path.is_file():
        raise ConfigError(f"config file `{path}` does not exist; check the path")
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text) if suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        kind = "JSON" if suffix == ".json" else "YAML"
        raise ConfigError(f"config file `{path}` is not valid {kind}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file `{path}`: top level is {type(data).__name__}; expected a mapping of config keys")
    return data


def load_configs(path: str | os.PathLike[str]) -> dict[str, Config]:
    """Load a file of named configs, `engines: {name: {...}, ...}`, validating each one.

    Problems in every engine are reported together, with paths like `engines.teacher.zero_optimization.stage`.
    """
    data = _read(Path(path))
    engines = data.get("engines")
    extra = sorted(str(k) for k in data if k != "engines")
    if not isinstance(engines, dict) or not engines or extra:
        found = f"top-level keys {sorted(map(str, data))}" if data else "an empty file"
        expected = ("expected a single top-level key `engines` mapping engine names to configs, "
                    "e.g. `engines: {student: {...}, teacher: {...}}`")
        raise ConfigError(f"{expected}; found {found}", str(path))
    configs: dict[str, Config] = {}
    problems: list[str] = []
    for name, raw in engines.items():
        try:
            configs[str(name)] = Config._validate(raw, prefix=("engines", str(name)))
        except ConfigError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ConfigError(problems, str(path))
    return configs


_BOUND_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")
_SYMBOLS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def _model_at(loc: Sequence[str]) -> type[_Section] | None:
    """The section model that a key path inside a Config points into (None past a free-form dict)."""
    model: type[_Section] = Config
    for part in loc:
        field = model.model_fields.get(part)
        if field is None:
            return None
        candidates = [field.annotation, *typing.get_args(field.annotation)]
        subs = [c for c in candidates if isinstance(c, type) and issubclass(c, _Section)]
        if not subs:
            return None
        model = subs[0]
    return model


def _allowed_range(loc: Sequence[str], ctx: Mapping[str, Any]) -> str:
    """Render a numeric field's full range (both bounds), falling back to the one bound pydantic names."""
    owner = _model_at(loc[:-1]) if loc else None
    field = owner.model_fields.get(loc[-1]) if owner else None
    metadata = field.metadata if field else []
    bounds = {k: getattr(m, k) for m in metadata for k in _SYMBOLS if getattr(m, k, None) is not None}
    bounds = bounds or dict(ctx)
    is_int = field is not None and int in (field.annotation, *typing.get_args(field.annotation))
    noun = "an integer" if is_int else "a number"
    if "ge" in bounds and "le" in bounds:
        return f"{noun} in {bounds['ge']}..{bounds['le']}"
    return noun + " " + " and ".join(f"{_SYMBOLS[k]} {v}" for k, v in bounds.items() if k in _SYMBOLS)


def _describe(err: Mapping[str, Any], loc: tuple[str, ...], prefix: tuple[str, ...]) -> list[str]:
    """Turn one pydantic error into problem lines."""
    path = ".".join(prefix + loc)
    kind = err["type"]
    cause = (err.get("ctx") or {}).get("error")
    if kind == "extra_forbidden":
        owner = _model_at(loc[:-1])
        if owner is not None and loc[-1] in owner.unsupported_keys:
            return [f"`{path}` is a DeepSpeed feature shardwise does not implement; remove it"]
        return [_line(path, "unknown", _suggest(loc[-1], owner.model_fields if owner else ()))]
    if isinstance(cause, _Problems):
        return [_line(".".join(prefix + loc + rel), k, detail) for rel, k, detail in cause.items]
    if kind == "missing":
        return [_line(path, "missing", "")]
    got = f"got {err['input']!r}"
    if kind in _BOUND_ERRORS:
        return [f"`{path}`: {got}; expected {_allowed_range(loc, err.get('ctx') or {})}"]
    if kind in ("model_type", "dict_type"):
        return [f"`{path or 'config'}`: {got}; expected a mapping of settings"]
    detail = str(cause) if cause is not None else err["msg"][:1].lower() + err["msg"][1:]
    return [f"`{path}`: {got}; {detail}"]


def _problems_from(exc: ValidationError, prefix: tuple[str, ...] = ()) -> list[str]:
    lines: list[str] = []
    for err in exc.errors(include_url=False):
        lines.extend(_describe(err, tuple(str(p) for p in err["loc"]), prefix))
    return lines
