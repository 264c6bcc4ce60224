"""A uniform training-step interface over shardwise and its peers.

Every system is wrapped in a :class:`Harness`: ``step(x, y, measure)`` runs one
forward, backward and optimizer update and returns the local loss; with
``measure`` it also fills ``state``, the per-rank tensor bytes, taken at the
same points for every system: gradients right after backward (reduced, before
the update), parameters, master weights and optimizer state right after the
update.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import nn

from .configs import System, Workload

__all__ = ["STATE_KINDS", "Harness", "ShardwiseHarness", "build_harness", "local_bytes"]

STATE_KINDS = ("parameters", "master_weights", "gradients", "optimizer_state")


class Harness(Protocol):
    """One system ready to train; see the module docstring."""

    state: dict[str, int]

    def step(self, x: torch.Tensor, y: torch.Tensor, measure: bool) -> torch.Tensor: ...

    def bytes_sent(self) -> int | None:
        """Bytes this rank sent through collectives since the last reset; None if not counted."""

    def reset_counters(self) -> None: ...


def local_bytes(tensors: Any) -> int:
    """Storage bytes this rank holds for the tensors in a (nested) container.

    A ``DTensor`` counts its local shard only; a tensor reached twice counts once.
    """
    from torch.distributed.tensor import DTensor

    seen: set[tuple[int, int, torch.dtype]] = set()
    total = 0
    for tensor in _walk(tensors):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        # Keyed by memory, not id(): to_local() returns a fresh object each call.
        key = (local.data_ptr(), local.numel(), local.dtype)
        if key not in seen:
            seen.add(key)
            total += local.numel() * local.element_size()
    return total


def _walk(item: Any) -> Iterable[torch.Tensor]:
    if isinstance(item, torch.Tensor):
        yield item
    elif isinstance(item, dict):
        for value in item.values():
            yield from _walk(value)
    elif isinstance(item, (list, tuple)):
        for value in item:
            yield from _walk(value)


class ShardwiseHarness:
    """A shardwise engine at ``system.stage`` with AdamW, bf16 from the config."""

    def __init__(self, model: nn.Module, system: System, workload: Workload) -> None:
        import shardwise

        config = {
            "train_micro_batch_size_per_gpu": workload.micro_batch,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": system.stage},
            "bf16": {"enabled": system.dtype == "bf16"},
        }
        optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr)
        self.engine = shardwise.initialize(model, optimizer, config=config)
        self.state: dict[str, int] = {}

    def step(self, x: torch.Tensor, y: torch.Tensor, measure: bool) -> torch.Tensor:
        _, loss = self.engine(x, y)
        self.engine.backward(loss)
        # engine.step() drops the gradients, so they are counted here.
        grads = self.engine.memory_breakdown()["gradients"] if measure else 0
        self.engine.step()
        if measure:
            counts = self.engine.memory_breakdown()
            self.state = {kind: int(counts.get(kind, 0)) for kind in STATE_KINDS}
            self.state["gradients"] = int(grads)
        return loss.detach()

    def bytes_sent(self) -> int | None:
        return int(sum(self.engine.comm.bytes_sent.values()))

    @property
    def transport(self) -> str:
        return self.engine.comm.shm.name(self.engine.comm.backend)

    def reset_counters(self) -> None:
        self.engine.comm.reset_counters()


def build_harness(system: System, model: nn.Module, workload: Workload) -> Harness:
    """Wrap ``model`` (already on this rank, seeded) for ``system``."""
    if system.is_shardwise:
        return ShardwiseHarness(model, system, workload)
    if system.family == "deepspeed":
        from .deepspeed_peer import DeepSpeedHarness

        return DeepSpeedHarness(model, system, workload)
    from .peers import DDPHarness, FSDP2Harness

    if system.family in ("ddp", "zero1"):
        return DDPHarness(model, system, workload)
    return FSDP2Harness(model, system, workload)
