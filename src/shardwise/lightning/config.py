"""The engine's config for a Lightning run: the strategy's arguments (or a DeepSpeed config), then the Trainer's.

One rule for both (docs/lightning.md, "Arguments, against `DeepSpeedStrategy`"): an argument fills in what the config
leaves unsaid, and one that contradicts it is an error.  Lightning runs the accumulation itself, so the engine gets
``gradient_accumulation_steps: 1``.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from shardwise.config import Config, ConfigError, read_config_file
from shardwise.deepspeed.defaults import announce, apply_defaults

__all__ = ["PRECISIONS", "StrategyConfig", "TrainerFacts"]

ConfigSource = Union[Mapping[str, Any], str, "os.PathLike[str]", Config, None]

#: Lightning's precision flags and the config sections they become (as ``DeepSpeedStrategy`` maps them:
#: the engine keeps fp32 master weights under either 16-bit flag)
PRECISIONS: dict[str, dict[str, dict[str, Any]]] = {
    "32-true": {},
    "bf16-mixed": {"bf16": {"enabled": True}},
    "bf16-true": {"bf16": {"enabled": True}},
    "16-mixed": {"fp16": {"enabled": True}},
    "16-true": {"fp16": {"enabled": True}},
}
_HALF = {"fp16": "16-mixed", "bf16": "bf16-mixed"}


@dataclass(frozen=True)
class TrainerFacts:
    """What the Trainer decides about a run."""

    precision: str
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = None
    world_size: int = 1


@dataclass(frozen=True)
class StrategyConfig:
    """The user's config with the strategy's arguments merged in (validated when the strategy is built)."""

    raw: dict[str, Any]
    #: the file it came from, to head errors
    source: Optional[str] = None
    #: fp16 loss-scaling arguments given to the strategy (``loss_scale``, ``initial_scale_power``, ...)
    loss_scaling: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_arguments(cls, config: ConfigSource, stage: Optional[int], offload: Mapping[str, Any],
                       loss_scaling: Mapping[str, Any]) -> StrategyConfig:
        """Merge ``stage`` and the ``offload`` sections into ``config``; None leaves a key to the config."""
        raw, source = _read(config)
        zero = raw.setdefault("zero_optimization", {})
        if isinstance(zero, dict):
            default_stage = 2 if config is None else None  # DeepSpeedStrategy's default stage
            _merge(zero, "stage", stage if stage is not None else default_stage, "stage")
            for key, section in offload.items():
                _merge_offload(zero, key, section)
        made = cls(raw, source, {k: v for k, v in loss_scaling.items() if v is not None})
        made.base()  # a bad config fails where the strategy is built, not at `fit`
        return made

    def base(self) -> Config:
        """The config as given (no Trainer facts yet), validated."""
        return Config.load(self.raw, name=self.source)

    @property
    def stage(self) -> int:
        return self.base().zero_optimization.stage

    def for_run(self, facts: TrainerFacts) -> Config:
        """The engine's config for a run the Trainer describes, with the DeepSpeed dialect's defaults."""
        raw = copy.deepcopy(self.raw)
        _precision(raw, facts.precision, self.loss_scaling)
        _batches(raw, facts)
        _clipping(raw, facts.gradient_clip_val)
        config = Config.load(raw, name=self.source)
        config, choices = apply_defaults(config, client_optimizer=False, user_backward=False)
        announce(choices)
        return config


def _read(config: ConfigSource) -> tuple[dict[str, Any], Optional[str]]:
    if config is None:
        return {}, None
    if isinstance(config, Config):
        return config.to_dict(), None
    if isinstance(config, (str, os.PathLike)):
        data = read_config_file(Path(config))
        if not isinstance(data, dict):
            raise ConfigError(f"{config} holds a `{type(data).__name__}`; a config is a mapping of keys", str(config))
        return data, str(config)
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config)), None
    raise TypeError(f"ShardwiseStrategy(config=...) got a `{type(config).__name__}`; pass a dict, a path to a "
                    "`.json`/`.yaml` DeepSpeed or shardwise config, or a `shardwise.Config`")


def _merge(section: dict[str, Any], key: str, value: Any, argument: str) -> None:
    if value is None:
        return
    if key in section and section[key] != value:
        raise ConfigError(f"ShardwiseStrategy({argument}={value!r}) contradicts the config's "
                          f"`zero_optimization.{key}: {section[key]!r}`; keep one of them")
    section[key] = value


def _merge_offload(zero: dict[str, Any], key: str, section: Mapping[str, Any]) -> None:
    given = zero.get(key)
    if isinstance(given, dict) and given.get("device", "none") != section["device"]:
        argument = "offload_optimizer" if key == "offload_optimizer" else "offload_parameters"
        raise ConfigError(f"ShardwiseStrategy({argument}=True, device {section['device']!r}) contradicts the "
                          f"config's `zero_optimization.{key}.device: {given.get('device')!r}`; keep one of them")
    if not isinstance(given, dict):
        zero[key] = dict(section)


def _enabled(raw: dict[str, Any], key: str) -> bool:
    section = raw.get(key)
    return isinstance(section, dict) and section.get("enabled") is True


def _precision(raw: dict[str, Any], precision: str, loss_scaling: Mapping[str, Any]) -> None:
    """The Trainer's ``precision`` as config sections; a config enabling another precision is an error."""
    if precision not in PRECISIONS:
        raise ValueError(f"ShardwiseStrategy supports `Trainer(precision=...)` {sorted(PRECISIONS)}, not "
                         f"{precision!r}; pick one of them")
    wanted = PRECISIONS[precision]
    for key, flag in _HALF.items():
        if _enabled(raw, key) and key not in wanted:
            raise ConfigError(f"the config enables `{key}` but the Trainer runs `precision={precision!r}`; set "
                              f"`Trainer(precision={flag!r})` or remove `{key}` from the config")
        section = raw.get(key)
        if isinstance(section, dict) and section.get("enabled") == "auto":  # Hugging Face's: follow the Trainer
            section["enabled"] = key in wanted
    for key, section in wanted.items():
        existing = raw.get(key)
        given: dict[str, Any] = existing if isinstance(existing, dict) else {}
        if key == "fp16" and loss_scaling:
            clash = sorted(k for k in loss_scaling if k in given and given[k] != loss_scaling[k])
            if clash:
                raise ConfigError(f"ShardwiseStrategy's {clash} contradict the config's `fp16` section; keep one")
            given = {**given, **loss_scaling}
        raw[key] = {**given, **section}


def _batches(raw: dict[str, Any], facts: TrainerFacts) -> None:
    """Accumulation is the Trainer's (``accumulate_grad_batches``); the config's batch keys must agree with it."""
    steps = facts.accumulate_grad_batches
    given = raw.get("gradient_accumulation_steps")
    if given not in (None, "auto") and given != steps:
        raise ConfigError(
            f"the config's `gradient_accumulation_steps: {given!r}` differs from `Trainer(accumulate_grad_batches="
            f"{steps})`: Lightning runs the accumulation; set `accumulate_grad_batches={given!r}` and remove the key")
    micro = raw.get("train_micro_batch_size_per_gpu")
    micro = micro if isinstance(micro, int) and not isinstance(micro, bool) else None
    train = raw.get("train_batch_size")
    if train not in (None, "auto"):
        # DeepSpeed's rule train = micro × accumulation × world, checked with the Trainer's accumulation
        sizes = Config.load({"train_batch_size": train, "train_micro_batch_size_per_gpu": micro,
                             "gradient_accumulation_steps": steps}).batch_sizes(facts.world_size)
        micro = sizes.micro_batch_size
    raw.pop("train_batch_size", None)
    raw["gradient_accumulation_steps"] = 1
    if micro is None:
        raw.pop("train_micro_batch_size_per_gpu", None)
    else:
        raw["train_micro_batch_size_per_gpu"] = micro


def _clipping(raw: dict[str, Any], trainer_value: Optional[float]) -> None:
    """``Trainer(gradient_clip_val=...)`` is the clipping norm unless the config sets one (then they must agree)."""
    given = raw.get("gradient_clipping")
    if given in (None, "auto"):
        raw["gradient_clipping"] = float(trainer_value or 0.0)
        return
    numeric = isinstance(given, (int, float)) and not isinstance(given, bool)
    if trainer_value is not None and numeric and float(given) != float(trainer_value):
        raise ConfigError(f"the config's `gradient_clipping: {given}` differs from `Trainer(gradient_clip_val="
                          f"{trainer_value})`; keep one of them")
