"""Shared pieces of the Trainer tests: a tiny model with dropout, synthetic data, engine configs."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import shardwise


class TinyNet(nn.Module):
    """Two linear layers with dropout between them (so resuming must restore the RNG streams)."""

    def __init__(self, dim: int = 6, hidden: int = 12, out: int = 4, dropout: float = 0.2) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.fc2(self.drop(torch.tanh(self.fc1(x)))).float(), y.float())


def dataset(n: int, seed: int = 1, dim: int = 6, out: int = 4) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=gen)
    return TensorDataset(x, torch.tanh(x[:, :out] * 2) + 0.1 * torch.randn(n, out, generator=gen))


def config(stage: int, micro: int = 2, accumulation: int = 2, **sections: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 50, "stage3_param_persistence_threshold": 0},
        "checkpoint": {"timeout": 60},
        "steps_per_print": 2,
    }
    cfg.update(sections)
    return {key: value for key, value in cfg.items() if value is not None}  # `scheduler=None` drops the section


def engine(stage: int, seed: int = 0, dropout: float = 0.2, **cfg: Any) -> Any:
    torch.manual_seed(seed)
    return shardwise.initialize(TinyNet(dropout=dropout), config=config(stage, **cfg))


def full_weights(engine: Any) -> dict[str, torch.Tensor]:
    """Full fp32 weights on every rank (collective)."""
    import torch.distributed as dist

    box = [engine.full_state_dict()]
    dist.broadcast_object_list(box, src=0)
    return box[0]
