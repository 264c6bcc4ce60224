"""Keeping tied weights equal across the stages that hold them.

A tied key used on several stages (an embedding on the first, the head that
reuses it on the last) has one copy per stage.  The copies start equal (the
first stage holding the key broadcasts its values), and before every
optimizer step their gradients are summed over those stages, so every copy
takes the step a single shared parameter would: the gradient of one module
used twice is the sum of both uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..distributed import Comm
from .module import PipelineModule
from .topology import PipeGroups

__all__ = ["TiedWeights"]


@dataclass
class _Tied:
    key: str
    stages: tuple[int, ...]
    params: list[tuple[str, nn.Parameter]]
    comm: Comm


class TiedWeights:
    """This stage's tied parameters shared with other stages, and their groups."""

    def __init__(self, module: PipelineModule, groups: PipeGroups) -> None:
        self.stage = groups.stage
        self.entries = [
            _Tied(key, stages, params, groups.ties[stages]) for key, stages, params in module.tied_parameters()
        ]

    def broadcast(self) -> None:
        """Make every stage's copy equal to the first stage's (collective over each tie group)."""
        with torch.no_grad():
            for entry in self.entries:
                for _, param in entry.params:
                    entry.comm.broadcast(param.data, src=0)  # group rank 0: the first stage holding the key

    def reduce_grads(self) -> None:
        """Sum each tied parameter's gradient over the stages holding it (collective)."""
        for entry in self.entries:
            for _, param in entry.params:
                if param.grad is None:  # unused here, or frozen: still take part, the others wait for us
                    param.grad = torch.zeros_like(param)
                entry.comm.all_reduce(param.grad)

    def copies(self) -> frozenset[str]:
        """Names of the tied parameters whose first holder is another stage: counted there, not here."""
        return frozenset(name for e in self.entries if e.stages[0] != self.stage for name, _ in e.params)
