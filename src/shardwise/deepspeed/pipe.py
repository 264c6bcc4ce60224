"""`deepspeed.pipe`: `PipelineModule` with DeepSpeed's signature, `LayerSpec`, `TiedLayerSpec`, topologies.

The classes are shardwise's (:mod:`shardwise.pipe`); only `PipelineModule`'s argument order and
DeepSpeed-only arguments (`topology`, `seed_fn`, `checkpointable_layers`, `dynamic_shape`) differ.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from shardwise.pipe import LayerSpec, TiedLayerSpec
from shardwise.pipe import PipelineModule as _PipelineModule
from shardwise.pipe.layers import CheckpointFn
from shardwise.pipe.module import LayerEntry

from .topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = [
    "LayerSpec", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineModule",
    "ProcessTopology", "TiedLayerSpec",
]


class PipelineModule(_PipelineModule):
    """DeepSpeed's `PipelineModule(layers, num_stages, topology, loss_fn, seed_layers, seed_fn, base_seed,
    partition_method, activation_checkpoint_interval, activation_checkpoint_func, checkpointable_layers,
    dynamic_shape)` over :class:`shardwise.pipe.PipelineModule`.

    `topology` gives the number of stages (its `pipe` axis; a `model` axis must be 1). Activations may
    change shape between micro-batches whatever `dynamic_shape` says. `seed_fn` and
    `checkpointable_layers` are DeepSpeed features shardwise lacks: errors unless None.
    """

    def __init__(
        self,
        layers: Sequence[LayerEntry],
        num_stages: Optional[int] = None,
        topology: Optional[ProcessTopology] = None,
        loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
        seed_layers: bool = False,
        seed_fn: Optional[Callable[[int], None]] = None,
        base_seed: int = 1234,
        partition_method: Any = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Optional[CheckpointFn] = None,
        checkpointable_layers: Optional[list[str]] = None,
        dynamic_shape: bool = False,
    ) -> None:
        _unsupported("seed_fn", seed_fn, "seeds each layer with `torch.manual_seed(base_seed + index)`; drop it")
        _unsupported("checkpointable_layers", checkpointable_layers,
                     "checkpoints every `activation_checkpoint_interval` layers; drop it")
        super().__init__(
            layers, num_stages=_stages(num_stages, topology), loss_fn=loss_fn, partition_method=partition_method,
            activation_checkpoint_interval=activation_checkpoint_interval,
            activation_checkpoint_func=activation_checkpoint_func, seed_layers=seed_layers, base_seed=base_seed,
        )


def _unsupported(name: str, value: Any, instead: str) -> None:
    if value is not None:
        raise ValueError(f"PipelineModule(`{name}`={value!r}): a DeepSpeed option shardwise does not implement "
                         f"(shardwise {instead})")


def _stages(num_stages: Optional[int], topology: Optional[ProcessTopology]) -> Optional[int]:
    if topology is None:
        if num_stages is None:
            raise ValueError("PipelineModule needs `num_stages` or `topology` (as DeepSpeed's does); e.g. `num_stages=2`")
        return num_stages
    if "model" in topology.get_axis_names() and topology.get_dim("model") > 1:
        raise ValueError(f"PipelineModule(topology=...) has {topology.get_dim('model')} model-parallel ranks; "
                         "shardwise has no tensor/model parallelism: use `PipeDataParallelTopology(num_pp, num_dp)`")
    stages = topology.get_dim("pipe")
    if num_stages is not None and num_stages != stages:
        raise ValueError(f"PipelineModule got num_stages={num_stages} and a topology of {stages} stages; pass one")
    return stages
