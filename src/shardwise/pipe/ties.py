"""Keeping tied weights equal across the stages that hold them (docs/pipeline.md, "Tied layers").

The copies start equal and their gradients are summed over those stages before every step. Only ``tied_weight_attr``
is kept equal, as in DeepSpeed; a tied module's other parameters trained on two stages would drift apart, which
:meth:`TiedWeights.check_untied` refuses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..comm.distributed import Comm
from .module import TIED_PREFIX, PipelineModule
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
        self.pipe = groups.pipe
        self.untied = module.untied_parameters()
        self.entries = [
            _Tied(key, stages, params, groups.ties[stages]) for key, stages, params in module.tied_parameters()]

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

    def check_untied(self) -> None:
        """Raise on every stage when an untied parameter of a tied module got a gradient on more than one
        stage in this batch (collective over the pipeline's stages; nothing when there are none)."""
        if not self.untied:
            return
        device = next((p.device for _, _, p in self.untied if p is not None), None)
        trained = torch.tensor([float(p is not None and p.requires_grad and p.grad is not None)
                                for _, _, p in self.untied], device=device)
        self.pipe.all_reduce(trained)
        twice = [f"{TIED_PREFIX}{key}.{name}" for (key, name, _), n in zip(self.untied, trained.tolist()) if n > 1]
        if twice:
            raise RuntimeError(
                f"rank {self.pipe.rank}: {twice} got a gradient on {int(max(trained.tolist()))} pipeline stages, but "
                "only a TiedLayerSpec's `tied_weight_attr` is kept equal across stages: each stage would train its "
                "own copy and they would drift apart; nothing was trained. Add them to `tied_weight_attr`, or use "
                "them on one stage only (e.g. in a `forward_fn` that reads only the tied weight)")

    def copies(self) -> frozenset[str]:
        """Names of the tied parameters whose first holder is another stage: counted there, not here."""
        return frozenset(name for e in self.entries if e.stages[0] != self.stage for name, _ in e.params)

    def written_elsewhere(self) -> frozenset[str]:
        """What a checkpoint takes from the first stage holding the key, not from this one: the tied
        copies, and the untied parameters of a tied module (the first stage's copy is the one saved)."""
        firsts = {e.key: e.stages[0] for e in self.entries}
        untied = {f"{TIED_PREFIX}{key}.{name}" for key, name, _ in self.untied if firsts.get(key, self.stage) != self.stage}
        return self.copies() | untied
