"""shardwise: data-parallel training with ZeRO stages 0-3 for PyTorch."""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch.distributed as dist
from torch import nn

from . import pipe, testing, zero
from .config import Config, ConfigError, load_configs
from .distributed import init_distributed
from .engine import Engine
from .optim import ShardwiseOptimizer

__all__ = [
    "Config",
    "ConfigError",
    "Engine",
    "ShardwiseOptimizer",
    "init_distributed",
    "initialize",
    "load_configs",
    "pipe",
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

    A :class:`shardwise.pipe.PipelineModule` with more than one stage gets a
    pipeline engine (``engine.train_batch(data_iter)``); with one stage it is
    an ordinary module and gets an ordinary engine.
    """
    resolved = Config.load(config if config is not None else {})
    if not dist.is_initialized():
        init_distributed(timeout=resolved.dist_timeout)
    if isinstance(model, pipe.PipelineModule) and model.num_stages > 1:
        from .pipe.engine import PipelineEngine  # stages × replicas: `train_batch` / `eval_batch`

        engine_class: type[Engine] = PipelineEngine
    else:
        engine_class = Engine
    return engine_class(
        model,
        resolved,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        model_parameters=model_parameters,
        process_group=process_group,
        name=name,
    )
