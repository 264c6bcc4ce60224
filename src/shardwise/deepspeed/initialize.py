"""`initialize` with DeepSpeed's signature and 4-tuple, over `shardwise.initialize`, and the command-line flags
that name its config (`add_config_arguments`)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import shardwise
from shardwise.config import Config
from shardwise.engine.engine import Engine
from shardwise.pipe import PipelineModule
from shardwise.pipe.engine import PipelineEngine

from .comm import init_distributed
from .defaults import DialectChoice, announce, apply_defaults
from .utils import RepeatingLoader

__all__ = ["add_config_arguments", "initialize", "pipeline_dataloader", "training_dataloader"]

ConfigSource = Config | dict[str, Any] | str | os.PathLike[str]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `--deepspeed`, `--deepspeed_config` (and the deprecated `--deepscale*`) and `--local_rank`, whose default
    is torchrun's `LOCAL_RANK` (why: docs/from-deepspeed.md, "What `shardwise.deepspeed` provides")."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (read by shardwise.deepspeed)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed (a flag for the script; shardwise needs no switch)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON (or YAML) config file")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    local_rank = int(os.environ.get("LOCAL_RANK", "").strip() or -1)  # -1: DeepSpeed's "not distributed"
    try:
        group.add_argument("--local_rank", "--local-rank", type=int, default=local_rank,
                           help="this process's rank on its node (default: torchrun's LOCAL_RANK, else -1)")
    except argparse.ArgumentError:
        # The script declared it already (usually with default -1).
        if local_rank >= 0:
            parser.set_defaults(local_rank=local_rank)
    return parser


def _config_source(args: Any, config: ConfigSource | None, config_params: ConfigSource | None) -> ConfigSource:
    """The config from `config`, its old name `config_params`, or `args.deepspeed_config` (one of them)."""
    config = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None and config is not None:
        raise ValueError(
            f"shardwise.deepspeed.initialize got a config twice: `args.deepspeed_config` ({from_args!r}) and "
            "`config=`; pass only one of them")
    chosen = config if config is not None else from_args
    if chosen is None:
        raise ValueError(
            "shardwise.deepspeed.initialize needs a config: pass `config=` (a dict or a path), or run the script "
            "with `--deepspeed_config FILE` after `add_config_arguments(parser)`")
    return chosen


def _reject(name: str, value: Any, feature: str) -> None:
    if value is not None:
        raise ValueError(f"shardwise.deepspeed.initialize: `{name}=` asks for {feature}, which shardwise does not "
                         f"implement; leave `{name}` unset (data parallelism over the world group)")


def training_dataloader(
    engine: Engine, dataset: Dataset[Any], collate_fn: Callable[..., Any] | None = None
) -> DataLoader[Any]:
    """DeepSpeed's training loader: `train_micro_batch_size_per_gpu` samples per batch over a `DistributedSampler` of
    the engine's ranks (seed 0: `loader.sampler.set_epoch(epoch)` for a new order), `dataloader_drop_last` honoured."""
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, num_replicas=engine.comm.world_size, rank=engine.comm.rank)
    return DataLoader(dataset, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler,
                      collate_fn=collate_fn, drop_last=engine.config.dataloader_drop_last)


def pipeline_dataloader(
    engine: Engine, dataset: Dataset[Any], collate_fn: Callable[..., Any] | None = None
) -> RepeatingLoader:
    """DeepSpeed's pipeline loader: as :func:`training_dataloader`, but in order (no shuffle), each
    data-parallel replica its share (every stage of a replica reads the same samples), repeating."""
    groups = engine.groups
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, num_replicas=groups.data.world_size, rank=groups.replica, shuffle=False)
    return RepeatingLoader(DataLoader(dataset, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler,
                                      collate_fn=collate_fn, drop_last=engine.config.dataloader_drop_last))


def _loader(engine: Engine, dataset: Dataset[Any], collate_fn: Callable[..., Any] | None) -> Any:
    """The third item of the 4-tuple; a pipeline engine's `train_batch()` also draws from it."""
    if not isinstance(engine, PipelineEngine):
        return training_dataloader(engine, dataset, collate_fn)
    loader = pipeline_dataloader(engine, dataset, collate_fn)
    engine.set_dataloader(loader)
    announce([DialectChoice(
        "the pipeline reads `training_data` in order, repeating, and `train_batch()` / `eval_batch()` without "
        "an iterator draw from it", "have no loader for a pipeline")])
    return loader


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Dataset[Any] | None = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[..., Any] | None = None,
    config: ConfigSource | None = None,
    mesh_param: Any = None,
    config_params: ConfigSource | None = None,
) -> tuple[Engine, Any, DataLoader[Any] | None, Any]:
    """DeepSpeed's `initialize`: returns `(engine, optimizer, training_dataloader, lr_scheduler)` (the arguments:
    docs/from-deepspeed.md, "What `shardwise.deepspeed` provides").  The process group is created when none exists
    (`dist_init_required=False` requires one); for a multi-stage pipeline the loader over `training_data` is an
    unshuffled, repeating one that `train_batch()` draws from.  DeepSpeed's defaults apply where the config is silent
    (:mod:`.defaults`).
    """
    if model is None:
        raise TypeError("shardwise.deepspeed.initialize needs `model=` (a torch.nn.Module)")
    _reject("mpu", mpu, "model parallelism")
    _reject("mesh_param", mesh_param, "a data × sequence parallel mesh")
    source = _config_source(args, config, config_params)
    loaded = Config.load(source)
    if dist_init_required is False and not dist.is_initialized():
        raise RuntimeError("shardwise.deepspeed.initialize(dist_init_required=False) found no process group; "
                           "create one first (`shardwise.deepspeed.init_distributed()`) or drop the argument")
    init_distributed(distributed_port=distributed_port, timeout=timedelta(seconds=loaded.dist_timeout))
    # A multi-stage pipeline engine runs backward and step itself, inside `train_batch`.
    stepped_by_user = not isinstance(model, PipelineModule) or model.num_stages == 1
    dialect, choices = apply_defaults(loaded, optimizer is not None, stepped_by_user, lr_scheduler is not None)
    engine = shardwise.initialize(model, optimizer=optimizer, config=dialect, lr_scheduler=lr_scheduler,
                                  model_parameters=model_parameters)
    engine.accumulates_backwards = stepped_by_user
    announce(choices)
    loader = _loader(engine, training_data, collate_fn) if training_data is not None else None
    engine.training_dataloader = loader
    return engine, engine.optimizer, loader, engine.lr_scheduler
