"""DeepSpeed's process topologies: named axes over the ranks, the last axis varying fastest.

`PipeDataParallelTopology(num_pp, num_dp)` lays ranks out stage-major, as shardwise's pipeline does
(:class:`shardwise.pipe.topology.PipeTopology`), so a topology given to `PipelineModule` names the
same ranks it will use.
"""

from __future__ import annotations

import itertools
from collections import namedtuple
from typing import Any

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "ProcessTopology"]


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
