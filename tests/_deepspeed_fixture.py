"""The tiny model, optimizer, config and data behind ``tests/fixtures/deepspeed/`` (see its README.md).

Shared by the generator (``tests/fixtures/deepspeed/make.py``, run with DeepSpeed
installed) and the tests that load its checkpoints into shardwise (which do not
need DeepSpeed): both must build exactly the same model and batches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"
SAVE_AFTER = 4  # optimizer steps before the checkpoint
CONTINUE = 3  # steps recorded after it
MICRO_BATCH = 4
#: (case name, ZeRO stage, "fp32" | "bf16" | "fp16"); every case is saved by 2 ranks
CASES = [
    (f"z{stage}_{dtype}", stage, dtype) for dtype in ("fp32", "bf16", "fp16") for stage in (0, 1, 2, 3)
]
#: the same, for :class:`Twins` (several parameters of one shape, listed out of module order)
TWIN_CASES = [(f"twins_z{stage}_fp32", stage, "fp32") for stage in (0, 1, 2, 3)] + [("twins_z0_bf16", 0, "bf16")]
VOCAB, WIDTH, SEQUENCE = 24, 8, 5


class Tiny(nn.Module):
    """180 parameters in two layers (odd sizes, so DeepSpeed pads its partitions) and one buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.inp = nn.Linear(6, 16)
        self.out = nn.Linear(16, 4)
        self.register_buffer("shift", torch.linspace(-0.5, 0.5, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x - self.shift.to(x.dtype))))


class Twins(nn.Module):
    """A tiny language model whose three matrices share one shape, (24, 8), and whose biases share (24,):
    an ``Embedding(24, 8)``, a ``Linear(8, 24)`` and a ``Linear(8, 24)`` head.  Its optimizer lists them
    out of module order, so only the order DeepSpeed wrote its state in says which state is whose."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.up = nn.Linear(WIDTH, VOCAB)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.emb(tokens)
        mixed = torch.tanh(self.up(hidden)).unflatten(-1, (VOCAB // WIDTH, WIDTH)).sum(-2)
        return self.head(hidden + mixed)


def twin_optimizer(model: Twins) -> torch.optim.Optimizer:
    """Matrices decay, biases do not; each group out of module order."""
    groups = [
        {"params": [model.head.weight, model.emb.weight, model.up.weight], "weight_decay": 0.1},
        {"params": [model.head.bias, model.up.bias], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=0.02, betas=(0.9, 0.99), eps=1e-8)


def twin_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens and next tokens at optimizer step ``step``."""
    gen = torch.Generator().manual_seed(5000 + 1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQUENCE + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def twin_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def param_groups(model: Tiny) -> list[dict[str, Any]]:
    """Two groups, not in module order: weights decay, biases do not."""
    return [
        {"params": [model.out.weight, model.inp.weight], "weight_decay": 0.1},
        {"params": [model.inp.bias, model.out.bias], "weight_decay": 0.0},
    ]


def optimizer(model: Tiny) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model), lr=0.02, betas=(0.9, 0.99), eps=1e-8)


def config(stage: int, dtype: str) -> dict[str, Any]:
    """The DeepSpeed config of a case; shardwise reads the same keys."""
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16", "initial_scale_power": 8, "loss_scale_window": 2},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02, "warmup_num_steps": 6, "warmup_type": "linear"},
        },
    }


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at optimizer step ``step`` (0-based), the same in every process."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(MICRO_BATCH, 6, generator=gen)
    y = torch.randn(MICRO_BATCH, 4, generator=gen)
    return x, y


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.float(), y)


def record(case: str) -> dict[str, Any]:
    """What the generator recorded of ``case``: losses per step per rank after the save, lrs."""
    data: dict[str, Any] = json.loads((FIXTURES / "record.json").read_text())[case]
    return data
