"""The engine a ``Trainer`` trains: the one it was given, or one it builds from a model and a config.

Built here, a scheduler's ``total_num_steps: auto`` resolves to the steps the Trainer will run (``max_steps``,
or ``epochs`` x the steps in one epoch, whichever ends first), as Hugging Face's Trainer resolves it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist
from torch import nn

from ..comm.distributed import init_distributed
from ..config import Config
from ..engine.initialization import initialize
from .data import train_source

__all__ = ["TOTAL_STEPS", "build_engine", "planned_steps", "steps_to_run"]

#: the config path a Trainer settles when it is ``auto``
TOTAL_STEPS = "scheduler.params.total_num_steps"


def build_engine(model_or_engine: Any, config: Any, train_data: Any, max_steps: Optional[int],
                 epochs: Optional[int]) -> Any:
    """``model_or_engine`` if it is an engine; otherwise ``shardwise.initialize(model, config=...)``."""
    if not isinstance(model_or_engine, nn.Module):
        if config is not None:
            raise ValueError(
                "`config=` was passed with an engine: the engine already has its config; pass the model "
                "(`Trainer(model, data, config=...)`) to have the Trainer build the engine, or drop `config=`")
        return model_or_engine
    if config is None:
        raise ValueError(
            f"`Trainer` got a `{type(model_or_engine).__name__}` model but no config: pass `config=` (a dict, a "
            "`.json`/`.yaml` path or a `shardwise.Config`), or an engine from `shardwise.initialize`")
    loaded = Config.load(config)
    if not dist.is_initialized():
        init_distributed(timeout=loaded.dist_timeout)
    if TOTAL_STEPS in loaded.pending:
        world = dist.get_world_size()
        total = planned_steps(train_data, loaded, world, max_steps, epochs)
        loaded = loaded.resolve(world_size=world, model=model_or_engine, total_num_steps=total)
    return initialize(model_or_engine, config=loaded)


def planned_steps(data: Any, config: Config, world: int, max_steps: Optional[int], epochs: Optional[int]) -> int:
    """The optimizer steps a Trainer will run, known before it starts; an error says when it cannot be."""
    sizes = config.batch_sizes(world)
    batches = train_source(data, micro=sizes.micro_batch_size, rank=dist.get_rank(), world=world, seed=0,
                           collate_fn=None, num_workers=0).batches_per_epoch  # counted as the Trainer will count them
    per_epoch = batches // sizes.gradient_accumulation_steps if batches is not None else None
    total = steps_to_run(max_steps, epochs, per_epoch)
    if total is None:
        raise ValueError(
            f"`{TOTAL_STEPS}` is `auto`, and `train_data` ({type(data).__name__}) has no length, so `epochs={epochs}` "
            "gives no step count: pass `max_steps=N` too, or set the scheduler's `total_num_steps` to a number")
    return max(total, 1)


def steps_to_run(max_steps: Optional[int], epochs: Optional[int], per_epoch: Optional[int]) -> Optional[int]:
    """``max_steps`` or ``epochs`` x ``per_epoch``, whichever ends first (None when neither is known)."""
    by_epochs = epochs * per_epoch if epochs is not None and per_epoch is not None else None
    candidates = [steps for steps in (max_steps, by_epochs) if steps is not None]
    return min(candidates) if candidates else None
