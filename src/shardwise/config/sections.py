"""The config sections shardwise implements, as pydantic models (one field per implemented key).

Keys follow DeepSpeed's JSON where the concept is the same. A section never sees DeepSpeed keys
that shardwise does not implement, aliases or `auto` values: `policy.prepare` settles those first.

Number fields take numbers only (docs/from-deepspeed.md, "Numbers take numbers"): pydantic's lax mode reads `true` as
1, and its strict mode refuses `2e8` for an integer, which every DeepSpeed config writes for bucket sizes. `Count` (an
int, or a float with no fractional part) and `Real` (an int or a finite float) sit between the two.
"""

from __future__ import annotations

import inspect
import math
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from . import registry
from .errors import MAX_SHOWN, Item, Problems, canonical, shown_value, suggest
from .limits import MAX_ELEMENTS, MAX_LOSS_SCALE, MAX_STEPS, MAX_TIMEOUT_S
from .registry import OPTIMIZERS, REQUIRED, SCHEDULES, OptimizerSpec, is_number, param_problems

__all__ = ["BF16Config", "CheckpointConfig", "CommsConfig", "Count", "FP16Config", "NotANumber", "OffloadConfig",
           "OffloadParamConfig", "OffloadSection", "OptimizerConfig", "Real", "SchedulerConfig", "Section",
           "ZeroConfig"]


class NotANumber(ValueError):
    """A value of the wrong kind for a number field; `describe` adds the field's range to the message."""


def _real(value: Any) -> Any:
    """An int or a finite float, else NotANumber saying what `value` is instead."""
    if isinstance(value, bool):
        raise NotANumber(f"`{str(value).lower()}` is a boolean, not a number; write the number")
    if isinstance(value, str):
        raise NotANumber("a string that is not a number; write the number without quotes")
    if not isinstance(value, (int, float)):
        raise NotANumber(f"a {type(value).__name__}, not a number")
    if isinstance(value, float) and not math.isfinite(value):
        raise NotANumber("not finite; write a finite value")
    return value


def _count(value: Any) -> Any:
    """As `_real`, and a float must be whole (`2e8`, as DeepSpeed configs write sizes): read as an int."""
    value = _real(value)
    if isinstance(value, float) and not value.is_integer():
        raise NotANumber("it has a fractional part; write a whole number")
    return int(value) if isinstance(value, float) else value


Count = Annotated[int, BeforeValidator(_count)]
Real = Annotated[float, BeforeValidator(_real)]


class Section(BaseModel):
    """Base of every section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


def _named(value: str, known: dict[str, Any], unsupported: dict[str, str], what: str) -> str:
    """The canonical name of `value`, or an error naming the DeepSpeed feature it would need."""
    lowered = {n.lower(): n for n in unsupported}
    if str(value).lower() in lowered:
        name = lowered[str(value).lower()]
        choices = ", ".join(f"`{n}`" for n in known)
        raise ValueError(f"`{name}` is {unsupported[name]}, which shardwise does not provide; use one of {choices}, "
                         f"or pass your own {what} to `initialize`")
    return canonical(value, known)


# name -> (lower bound, bound allowed): the torch arguments whose range we can check up front.
_OPTIMIZER_BOUNDS = {"lr": (0, True), "eps": (0, False), "weight_decay": (0, True), "momentum": (0, True)}


def _optimizer_value_problem(key: str, value: Any, spec: OptimizerSpec) -> str | None:
    if key == "bias_correction" and value is False:
        return ("false turns off the bias correction of Adam's moments, which torch's Adam always applies; remove "
                "the key, or pass your own optimizer to `initialize`")
    if key in spec.extras:
        return None if isinstance(value, bool) else "expected true or false"
    if key == "betas":
        ok = isinstance(value, (list, tuple)) and len(value) == 2
        ok = ok and all(is_number(b) and 0 <= b < 1 for b in value)
        return None if ok else "expected two numbers in [0, 1), e.g. `[0.9, 0.999]`"
    if key in _OPTIMIZER_BOUNDS:
        low, inclusive = _OPTIMIZER_BOUNDS[key]
        ok = is_number(value) and (value >= low if inclusive else value > low)
        return None if ok else f"expected a number {'>=' if inclusive else '>'} {low}"
    return _kind_problem(value, spec.default(key))


def _kind_problem(value: Any, default: Any) -> str | None:
    """A value of another kind than torch's default for the argument (`true` for a number, `0.9` for a flag)."""
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "expected true or false"
    if isinstance(default, (int, float)) and not is_number(value):
        return f"expected a number (torch's default is {default})"
    return None


def _hint(key: Any, known: Any, items: list[Item]) -> str:
    """The closest known keys, while the message still shows this problem (difflib costs ~1 ms a key)."""
    return suggest(key, known) if len(items) < MAX_SHOWN else "remove it"


class OptimizerConfig(Section):
    """`optimizer`: a torch optimizer by DeepSpeed name (`Adam`, `AdamW`, `SGD`, ...) and its arguments.

    `params` are torch's keyword arguments, plus DeepSpeed's Adam extras `adam_w_mode` (default true, as in DeepSpeed:
    `Adam` then means decoupled weight decay, i.e. AdamW) and `torch_adam` (accepted; shardwise always uses torch's
    implementation). The names are those of `shardwise.config.registry.OPTIMIZERS`.
    """

    type: str
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("type")
    @classmethod
    def _canonical_type(cls, value: str) -> str:
        return _named(value, OPTIMIZERS, registry.DEEPSPEED_ONLY_OPTIMIZERS, "optimizer")

    @model_validator(mode="after")
    def _check_params(self) -> OptimizerConfig:
        spec = OPTIMIZERS[self.type]
        known = spec.known_arguments()
        items: list[Item] = []
        for key, value in self.params.items():
            path = ("params", str(key))
            if key not in known:
                where = f"(not an argument of torch.optim.{spec.torch_class.__name__})"
                items.append((path, "unknown", f"{_hint(key, known, items)} {where}"))
            elif (problem := _optimizer_value_problem(key, value, spec)) is not None:
                items.append((path, "value", f"got {shown_value(value)}; {problem}"))
        if items:
            raise Problems(items)
        return self


# Integer scheduler arguments; JSON writers sometimes give them as 1e5, which we accept when whole.
_SCHEDULER_INT_KEYS = ("warmup_num_steps", "total_num_steps", "last_batch_iteration")


class SchedulerConfig(Section):
    """`scheduler`: one of DeepSpeed's `WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR` and its params."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)
    #: shardwise's own key: start as DeepSpeed's schedules do (the first optimizer step at iteration -1's
    #: lr, step `k` at iteration `k - 1`). The `shardwise.deepspeed` dialect sets it when it is absent.
    deepspeed_start: bool = False

    @field_validator("type")
    @classmethod
    def _canonical_type(cls, value: str) -> str:
        return _named(value, SCHEDULES, registry.DEEPSPEED_ONLY_SCHEDULES, "lr_scheduler")

    @model_validator(mode="after")
    def _check_params(self, info: ValidationInfo) -> SchedulerConfig:
        known = SCHEDULES[self.type]
        # Arguments given as `auto` resolve at initialize (the context's `pending` paths); they are checked then.
        pending = info.context.get("pending", ()) if isinstance(info.context, dict) else ()
        later = {p.rsplit(".", 1)[-1] for p in pending if p.startswith("scheduler.params.")}
        items: list[Item] = []
        for key in self.params:
            if key not in known:
                items.append((("params", str(key)), "unknown", _hint(key, known, items)))
        for name, default in known.items():
            if default is REQUIRED and name not in self.params and name not in later:
                fix = f" for {self.type}; set it to the total number of optimizer steps"
                items.append((("params", name), "missing", fix))
        for key in _SCHEDULER_INT_KEYS:
            value = self.params.get(key)
            if isinstance(value, float) and value.is_integer():
                self.params[key] = int(value)
        given = {k: v for k, v in self.params.items() if k in known}
        merged = {k: v for k, v in known.items() if v is not REQUIRED and k not in later} | given
        for name, problem in param_problems(merged):
            items.append((("params", name), "value", problem))
        if items:
            raise Problems(items)
        return self


class FP16Config(Section):
    """`fp16`: float16 mixed precision with loss scaling (`loss_scale` 0 means dynamic scaling)."""

    enabled: bool = False
    loss_scale: Real = Field(default=0.0, ge=0, le=MAX_LOSS_SCALE)
    initial_scale_power: Count = Field(default=16, ge=0, le=64)
    loss_scale_window: Count = Field(default=1000, ge=1, le=MAX_STEPS)
    hysteresis: Count = Field(default=2, ge=1, le=MAX_STEPS)
    min_loss_scale: Real = Field(default=1.0, gt=0, le=MAX_LOSS_SCALE)
    consecutive_hysteresis: bool = False


class BF16Config(Section):
    """`bf16` (legacy name `bfloat16`): bfloat16 mixed precision (no loss scaling needed)."""

    enabled: bool = False


class OffloadSection(Section):
    """What both offload sections share: `device`, `nvme_path`, `buffer_count`, `pin_memory`.

    `device: cpu`: on a job on an accelerator the state lives in host memory (ZeRO-Offload, docs/offload.md); on a CPU
    job that is where it already lives, so it is accepted with an info line. `pin_memory` pins the host buffers the
    copies to and from an accelerator use. `device: none` is dropped as off before these models see the section.
    """

    device: Literal["cpu", "nvme"] = "cpu"
    #: the folder under which each rank of each job makes its own uniquely named folder
    nvme_path: str | None = None
    pin_memory: bool = False

    @model_validator(mode="after")
    def _nvme_needs_a_path(self) -> "OffloadSection":
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError("`device: nvme` needs `nvme_path`, the folder the offloaded state is written under; "
                             "add `nvme_path: /path/to/fast/disk`")
        return self


class OffloadConfig(OffloadSection):
    """`zero_optimization.offload_optimizer` (stages 1-3): this rank's fp32 masters and optimizer state in files under
    `nvme_path` (`nvme`) or in host memory (`cpu`, on a job on an accelerator); what each key does: docs/offload.md."""

    #: sub-groups of state in host memory at once: the one stepped, those read ahead, those written behind
    buffer_count: Count = Field(default=4, ge=1, le=1024)
    #: the share of the optimizer state offloaded (DeepSpeed's partial offload), 0 < ratio <= 1: of the `n`
    #: sub-groups, the first `int((1 - ratio) * n)` keep their fp32 masters and state in host memory
    #: (moved back to a parameter's edge where they would cut one) and the rest live in the files
    ratio: Real = 1.0

    @field_validator("ratio")
    @classmethod
    def _a_share(cls, value: float) -> float:
        if not 0 < value <= 1:
            raise ValueError(
                "the share of the optimizer state offloaded is above 0 and at most 1; set it "
                "between them (0.5 keeps the first half of the sub-groups' state in host memory), or remove the key "
                "to offload all of it")
        return value


class OffloadParamConfig(OffloadSection):
    """`zero_optimization.offload_param` (stage 3): each unit's local shard in a file under `nvme_path` (`nvme`, a CPU
    job) or in host memory (`cpu`, on a job on an accelerator), read as the unit is gathered; docs/offload.md."""

    #: shards read ahead at once (DeepSpeed: buffers in the parameter swap pool)
    buffer_count: Count = Field(default=5, ge=1, le=1024)
    #: elements of shards kept in host memory at most, between uses (DeepSpeed's default)
    max_in_cpu: Count = Field(default=1_000_000_000, ge=0, le=MAX_ELEMENTS)


class ZeroConfig(Section):
    """`zero_optimization`: ZeRO stage (0 replicate, 1 shard optimizer state, 2 + gradients, 3 + params).

    Bucket sizes count elements, as in DeepSpeed. DeepSpeed's names without the `stage3_` prefix
    (`prefetch_bucket_size`, ...) and `stage3_gather_fp16_weights_on_model_save` are read as the fields here.
    """

    stage: Count = Field(default=0, ge=0, le=3)
    reduce_bucket_size: Count = Field(default=5_000_000, gt=0, le=MAX_ELEMENTS)
    #: stages 1-2: average gradients with a reduce-scatter (true) or an all-reduce (false); unset: by
    #: backend, an all-reduce on gloo (measured faster there) and a reduce-scatter otherwise
    reduce_scatter: bool | None = None
    stage3_prefetch_bucket_size: Count = Field(default=5_000_000, ge=0, le=MAX_ELEMENTS)
    stage3_max_live_parameters: Count = Field(default=1_000_000_000, ge=0, le=MAX_ELEMENTS)
    stage3_max_reuse_distance: Count = Field(default=1_000_000_000, ge=0, le=MAX_ELEMENTS)
    stage3_param_persistence_threshold: Count = Field(default=10_000, ge=0, le=MAX_ELEMENTS)
    #: write a 16-bit `pytorch_model.bin` / safetensors file of the full model at save time
    stage3_gather_16bit_weights_on_model_save: bool = False
    #: elements of the optimizer state stepped at a time when it is offloaded to NVMe (DeepSpeed's default)
    sub_group_size: Count = Field(default=1_000_000_000, gt=0, le=MAX_ELEMENTS)
    offload_optimizer: OffloadConfig | None = None
    offload_param: OffloadParamConfig | None = None


class CheckpointConfig(Section):
    """`checkpoint`: collective save/load behaviour (`timeout` in seconds for ranks to agree).

    `async_save` is known so that `false` is accepted; `true` is an error: a save always finishes before
    `save_checkpoint` returns (accepting it and saving synchronously would do silently less than asked).
    """

    timeout: Real = Field(default=300.0, gt=0, le=MAX_TIMEOUT_S)
    save_rng_state: bool = True
    allow_pickle: bool = False
    async_save: bool = False

    @field_validator("async_save")
    @classmethod
    def _synchronous_only(cls, value: bool) -> bool:
        if value:
            raise ValueError(
                "`true` asks for checkpoints written in the background while training goes on, which shardwise "
                "does not implement (`save_checkpoint` returns once the checkpoint is committed); remove the key "
                "or set it to false")
        return value


class CommsConfig(Section):
    """`comms`: how collectives fail (a shardwise section; DeepSpeed has no counterpart).

    `timeout`: seconds any collective may wait before every rank raises naming the ranks gone, failed or elsewhere.
    `debug`: check that every rank issues the same collective (one small all-reduce each). `shared_memory`: CPU ranks
    on one host reduce and gather through /dev/shm instead of loopback sockets (2-2.5x faster; docs/faults.md).
    """

    timeout: Real = Field(default=300.0, gt=0, le=MAX_TIMEOUT_S)
    debug: bool = False
    shared_memory: bool = True


def field_default(model: type[BaseModel], name: str) -> Any:
    """The default of field `name` of `model` (factories called)."""
    return model.model_fields[name].get_default(call_default_factory=True)


def upper_bound(model: type[BaseModel], name: str) -> Any:
    """The `le` bound of number field `name` of `model` (None: it has none)."""
    return next((m.le for m in model.model_fields[name].metadata if getattr(m, "le", None) is not None), None)


def section_of(annotation: Any) -> type[Section] | None:
    """The section model a field annotation holds (`X`, `X | None`), if any."""
    candidates = [annotation, *typing.get_args(annotation)]
    subs = [c for c in candidates if inspect.isclass(c) and issubclass(c, Section)]
    return subs[0] if subs else None
