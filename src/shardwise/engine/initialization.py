"""``shardwise.initialize``: a model, an optimizer and a config in, an engine out.

Its own module (re-exported by the package) so the trainer, which builds engines too, imports it without
importing the package's ``__init__``.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch.distributed as dist
from torch import nn

from .. import pipe
from ..comm.distributed import init_distributed
from ..config import Config
from ..log import install_default_handler
from ..pipe.engine import PipelineEngine
from .engine import Engine

__all__ = ["initialize"]


def initialize(model: nn.Module, optimizer: Any = None,
               config: Union[Config, dict[str, Any], str, "os.PathLike[str]", None] = None, lr_scheduler: Any = None,
               model_parameters: Any = None, process_group: Optional[dist.ProcessGroup] = None,
               name: Optional[str] = None) -> Engine:
    """Wrap ``model`` for training (or inference) across the ranks of ``process_group``.

    ``optimizer`` may be a ``torch.optim.Optimizer``, an object exposing ``param_groups``/``step``/``zero_grad``/
    ``state_dict``/``load_state_dict``, a callable ``params -> optimizer``, or None (then the config's
    ``optimizer`` section is used; with neither, the engine is inference-only).  ``config`` is a :class:`Config`,
    a dict, or a path to a ``.json``/``.yaml`` file.  If no process group exists yet one is created
    (:func:`init_distributed`), so a plain one-process run needs no launcher.  ``name`` names the engine (its
    checkpoints, its log lines) when several live in one process.  A :class:`shardwise.pipe.PipelineModule`
    with more than one stage gets a pipeline engine (``engine.train_batch(data_iter)``).
    """
    install_default_handler()  # before the config's info lines
    loaded = Config.load(config if config is not None else {})
    if not dist.is_initialized():
        init_distributed(timeout=loaded.dist_timeout)
    # Settle Hugging Face's `auto` values from what was passed, and the batch sizes for this world.
    backend = dist.get_backend(process_group)
    # a multi-stage pipeline's data-parallel replicas: its batch is micro × accumulation × replicas, as in DeepSpeed
    topology = model.topology if isinstance(model, pipe.PipelineModule) else None
    replicas = topology.replicas if topology is not None else None
    resolved = loaded.resolve(
        world_size=replicas or dist.get_world_size(process_group), model=model, optimizer=optimizer,
        lr_scheduler=lr_scheduler, device="cuda" if backend == "nccl" else "cpu",
    )
    engine_class: type[Engine] = PipelineEngine if replicas else Engine  # stages × replicas: `train_batch`
    return engine_class(model, resolved, optimizer=optimizer, lr_scheduler=lr_scheduler,
                        model_parameters=model_parameters, process_group=process_group, name=name)
