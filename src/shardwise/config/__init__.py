"""Validated shardwise configuration: DeepSpeed's keys, Hugging Face's `auto`, batch-size arithmetic.

One rule for every key (`policy.py`): a key shardwise implements (`sections.py`) acts as in DeepSpeed; any other key
DeepSpeed's schema knows (`catalog.py`) is accepted with an info line when it changes nothing here, and is an error
naming the feature when it turns one on; anything else is an unknown key, reported with the closest known one. `"auto"`
resolves from what is known (`auto.py`). Every invalid config raises :class:`ConfigError`, one line per problem with
its dotted key path. Reading is total and bounded (`limits.py`, `reading.py`): whatever a file or dict holds, the
outcome is a Config or a ConfigError within about a second. Defaults follow plain PyTorch: `gradient_clipping` is 0
(off) when absent, whereas recent DeepSpeed clips at 1.0. This package imports no shardwise runtime module.
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
