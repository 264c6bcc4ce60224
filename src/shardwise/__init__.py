"""shardwise: data-parallel training with ZeRO stages 0-3 for PyTorch."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from . import pipe, zero
from ._version import __version__ as __version__
from .comm.distributed import init_distributed
from .config import Config, ConfigError, load_configs
from .engine.engine import Engine
from .engine.initialization import initialize
from .engine.multi import load_checkpoints, save_checkpoints
from .optim.optimizers import ShardwiseOptimizer
from .trainer import Trainer

if TYPE_CHECKING:
    from . import testing

__all__ = [
    "Config",
    "ConfigError",
    "Engine",
    "ShardwiseOptimizer",
    "Trainer",
    "init_distributed",
    "initialize",
    "load_checkpoints",
    "load_configs",
    "pipe",
    "save_checkpoints",
    "testing",
    "zero",
]


def __getattr__(name: str) -> ModuleType:
    # `shardwise.testing` (the multi-rank test harness, ~760 lines) loads on first use: training needs none of it.
    if name == "testing":
        return importlib.import_module(".testing", __name__)
    raise AttributeError(f"module `shardwise` has no attribute `{name}`")
