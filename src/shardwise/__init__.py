"""shardwise: data-parallel training with ZeRO stages 0-3 for PyTorch."""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch.distributed as dist
from torch import nn

from . import testing, zero
from .config import Config, ConfigError, load_configs
from .distributed import init_distributed
from .engine import Engine
from .optim import ShardwiseOptimizer
from .trainer import Trainer

__all__ = [
    "Config",
    "ConfigError",
    "Engine",
    "ShardwiseOptimizer",
    "Trainer",
    "init_distributed",
    "initialize",
    "load_configs",
    "testing",
    "zero",
]

__version__ = "0.1.0"


def initialize(
    model: nn.Module,
    optimizer: Any = None,
    config: Union[Config, dict[str, Any], str, "os.PathLike[str]", None] = None,
    lr_scheduler: Any = None,
    model_parameters: Any = None,
    process_group: Optional[dist.ProcessGroup] = None,
    name: Optional[str] = None,
) -> Engine:
    """Wrap ``model`` for training (or inference) across the ranks of ``process_group``.

    ``optimizer`` may be a ``torch.optim.Optimizer``, an object exposing
    ``param_groups``/``step``/``zero_grad``/``state_dict``/``load_state_dict``, a
    callable ``params -> optimizer``, or None (then the config's ``optimizer``
    section is used; with neither, the engine is inference-only).  ``config`` is
    a :class:`Config`, a dict, or a path to a ``.json``/``.yaml`` file.  If no
    process group exists yet one is created (:func:`init_distributed`), so a
    plain one-process run needs no launcher.  ``name`` names the engine (its
    checkpoints, its log lines) when several live in one process.
    """
    resolved = Config.load(config if config is not None else {})
    if not dist.is_initialized():
        init_distributed(timeout=resolved.dist_timeout)
    return Engine(
        model,
        resolved,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        model_parameters=model_parameters,
        process_group=process_group,
        name=name,
    )
