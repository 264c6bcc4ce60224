"""Buffers as torch DDP treats them: rank 0's buffers are broadcast before each training forward.

A BatchNorm model trained at every stage ends with the same parameters *and
the same buffers on each rank* as torch DDP with ``broadcast_buffers`` on (its
default) and off (``broadcast_buffers: false``), fp32, tolerance 1e-6.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.testing import distributed_test

ATOL = 1e-6


class _BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.fc1 = nn.Linear(5, 12)
        self.norm = nn.BatchNorm1d(12)
        self.fc2 = nn.Linear(12, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.fc2(torch.tanh(self.norm(self.fc1(x)))), y)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(31 * step + rank)
    # each rank's data has another mean, so unsynchronised running statistics visibly differ
    return torch.randn(6, 5, generator=gen) + 2.0 * rank, torch.randn(6, 2, generator=gen)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().float().clone() for n, t in model.state_dict().items()}


def _ddp_run(steps: int, broadcast: bool) -> dict[str, torch.Tensor]:
    model = _BatchNormNet()
    ddp = nn.parallel.DistributedDataParallel(model, broadcast_buffers=broadcast)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        ddp(*_batch(step, dist.get_rank())).backward()
        opt.step()
        opt.zero_grad()
    return _state(model)


def _engine_run(stage: int, steps: int, **config: Any) -> dict[str, torch.Tensor]:
    model = _BatchNormNet()
    engine = shardwise.initialize(model, lambda p: torch.optim.SGD(p, lr=0.05),
                                  {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                                   **config})
    for step in range(steps):
        engine.backward(engine(*_batch(step, dist.get_rank())))
        engine.step()
    full = engine.full_state_dict()  # collective; parameters whole on rank 0
    state = {n: t.detach().float().clone() for n, t in model.named_buffers()}
    state.update({n: t.float() for n, t in full.items() if n not in state})
    engine.destroy()
    return state


@distributed_test(world_size=2, timeout=180)
def test_buffers_follow_rank0_before_each_forward_as_ddp_at_every_stage() -> None:
    steps = 4
    rank = dist.get_rank()
    for broadcast in (True, False):
        want = _ddp_run(steps, broadcast)
        for stage in (0, 1, 2, 3):
            got = _engine_run(stage, steps, broadcast_buffers=broadcast)
            for name in ("norm.running_mean", "norm.running_var", "norm.num_batches_tracked"):
                diff = (got[name] - want[name]).abs().max().item()
                assert diff <= ATOL, f"stage {stage}, broadcast {broadcast}, rank {rank}: {name} off DDP's by {diff:.3g}"
            if rank == 0:
                for name, value in want.items():
                    diff = (got[name] - value).abs().max().item()
                    assert diff <= ATOL, f"stage {stage}, broadcast {broadcast}: {name} off DDP's by {diff:.3g}"

