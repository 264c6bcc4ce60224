"""`deepspeed.pipe`: `PipelineModule` with DeepSpeed's signature, `LayerSpec`, `TiedLayerSpec`, topologies.

The classes are shardwise's (:mod:`shardwise.pipe`). `PipeDataParallelTopology(num_pp, num_dp)` lays ranks out
stage-major (the last axis varies fastest), as shardwise's pipeline does, so a topology given to `PipelineModule` names
the same ranks it will use.
"""

from __future__ import annotations

import itertools
from collections import namedtuple
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from shardwise.pipe import LayerSpec, TiedLayerSpec
from shardwise.pipe import PipelineModule as _PipelineModule
from shardwise.pipe.layers import CheckpointFn
from shardwise.pipe.module import LayerEntry

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineModule",
           "ProcessTopology", "TiedLayerSpec"]


class ProcessTopology:
    """Ranks as coordinates on `axes` of sizes `dims` (row-major: the last axis is contiguous)."""

    def __init__(self, axes: list[str], dims: list[int]) -> None:
        if len(axes) != len(dims) or len(set(axes)) != len(axes) or any(d < 1 for d in dims):
            raise ValueError(f"ProcessTopology(axes={axes}, dims={dims}): expected distinct axis names and one "
                             "size >= 1 per axis")
        self.axes = list(axes)
        self.dims = list(dims)
        coord: Any = namedtuple("ProcessCoord", self.axes)  # type: ignore[misc]  # axes known at run time
        self.ProcessCoord = coord
        self.mapping = {coord._make(c): rank
                        for rank, c in enumerate(itertools.product(*(range(d) for d in self.dims)))}

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def get_dim(self, axis: str) -> int:
        """The size of `axis` (0 for an axis the topology lacks, as DeepSpeed's)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def world_size(self) -> int:
        return len(self.mapping)

    def get_rank(self, **coords: int) -> int:
        """The rank at `coords` (every axis named)."""
        if sorted(coords) != sorted(self.axes):
            raise ValueError(f"get_rank({coords}): name every axis of {self.axes}")
        return self.mapping[self.ProcessCoord(**coords)]

    def get_coord(self, rank: int) -> Any:
        for coord, at in self.mapping.items():
            if at == rank:
                return coord
        raise ValueError(f"rank {rank} is not in this topology of {self.world_size()} ranks")

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks whose coordinate on `axis` is `idx`."""
        return sorted(rank for coord, rank in self.mapping.items() if getattr(coord, axis) == idx)

    def __str__(self) -> str:
        return f"ProcessTopology({dict(zip(self.axes, self.dims))})"


class PipeDataParallelTopology(ProcessTopology):
    """`num_pp` pipeline stages × `num_dp` data-parallel replicas."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Stages × replicas × model-parallel ranks; shardwise's pipeline takes it with `num_mp=1` only."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


class PipelineModule(_PipelineModule):
    """DeepSpeed's `PipelineModule` signature over :class:`shardwise.pipe.PipelineModule`.

    `topology` gives the number of stages (its `pipe` axis; a `model` axis must be 1). Activations may change shape
    between micro-batches whatever `dynamic_shape` says. `seed_fn` and `checkpointable_layers` are DeepSpeed features
    shardwise lacks: errors unless None.
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
