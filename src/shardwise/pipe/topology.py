"""Stages × data-parallel replicas: which rank is which, and the process groups.

Ranks are laid out stage-major, as DeepSpeed's ``PipeDataParallelTopology`` (rank ``= stage × replicas +
replica``), so the replicas of one stage, whose gradient reductions are the heavy traffic, are neighbours.
Every rank creates every group in the same order, as ``torch.distributed.new_group`` requires.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch.distributed as dist

from ..comm.distributed import Comm

__all__ = ["PipeGroups", "PipeTopology"]


@dataclass(frozen=True)
class PipeTopology:
    """``num_stages`` pipeline stages, each replicated ``replicas`` times."""

    num_stages: int
    replicas: int

    @classmethod
    def for_world(cls, world_size: int, num_stages: int) -> "PipeTopology":
        if world_size % num_stages:
            raise ValueError(
                f"the world size {world_size} is not divisible by num_stages={num_stages}: every stage needs "
                f"the same number of data-parallel replicas; launch a multiple of {num_stages} ranks or pass "
                f"a `num_stages` that divides {world_size}")
        return cls(num_stages, world_size // num_stages)

    def stage_of(self, rank: int) -> int:
        return rank // self.replicas

    def pipe_ranks(self, replica: int, stages: Optional[Iterable[int]] = None) -> list[int]:
        """The ranks of ``stages`` (default: all) in one replica, in stage order."""
        return [s * self.replicas + replica for s in (range(self.num_stages) if stages is None else stages)]


@dataclass
class PipeGroups:
    """This rank's communicators.

    ``pipe``: the stages of this replica (norm and loss collectives); ``p2p``: the same ranks, used only for activations
    and gradients (a group of their own, so point-to-point tags never meet collective ones); ``data``: this stage's
    replicas (gradient averaging, ZeRO-1); ``ties``: per set of stages sharing a tied key, those stages of this replica.
    """

    topology: PipeTopology
    rank: int
    pipe: Comm
    p2p: Comm
    data: Comm
    world: Comm
    ties: dict[tuple[int, ...], Comm] = field(default_factory=dict)

    @property
    def stage(self) -> int:
        return self.topology.stage_of(self.rank)

    @property
    def replica(self) -> int:
        return self.rank % self.topology.replicas

    @classmethod
    def create(cls, topology: PipeTopology, tie_stages: Iterable[tuple[int, ...]] = ()) -> "PipeGroups":
        """Create every group (collective: all ranks, same order)."""
        rank, replicas = dist.get_rank(), topology.replicas
        mine: dict[str, Comm] = {}

        def make(name: str, ranks: list[int]) -> None:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[name] = Comm(group)

        for replica in range(replicas):
            make("pipe", topology.pipe_ranks(replica))
            make("p2p", topology.pipe_ranks(replica))
        for stage in range(topology.num_stages):
            make("data", list(range(stage * replicas, (stage + 1) * replicas)))
        ties: dict[tuple[int, ...], Comm] = {}
        for stages in sorted(set(tie_stages)):
            for replica in range(replicas):
                make("tie", topology.pipe_ranks(replica, stages))
            if "tie" in mine:
                ties[stages] = mine.pop("tie")
        return cls(topology, rank, mine["pipe"], mine["p2p"], mine["data"], Comm(None), ties)
