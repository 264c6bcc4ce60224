"""Validated shardwise configuration: DeepSpeed's keys, Hugging Face's `auto`, batch-size arithmetic.

One rule for every key (`policy.py`; docs/from-deepspeed.md, "One rule for every config key"), `"auto"` resolved from
what is known (`auto.py`), every invalid config a :class:`ConfigError` with one line per problem, and reading total and
bounded (`limits.py`, `reading.py`). Defaults follow plain PyTorch: `gradient_clipping` is 0 (off) when absent, whereas
recent DeepSpeed clips at 1.0. This package imports no shardwise runtime module.
"""

from __future__ import annotations

from .errors import ConfigError, Note
from .model import BatchSizes, Config, load_configs
from .reading import read_config_file
from .sections import (
    BF16Config,
    CheckpointConfig,
    CommsConfig,
    FP16Config,
    OffloadConfig,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
)

__all__ = ["BF16Config", "BatchSizes", "CheckpointConfig", "CommsConfig", "Config", "ConfigError", "FP16Config", "Note",
           "OffloadConfig", "OptimizerConfig", "SchedulerConfig", "ZeroConfig", "load_configs", "read_config_file"]
