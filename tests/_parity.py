"""Shared pieces of the parity tests: a model, per-rank data, and references.

The model avoids parameters whose true gradient is zero (see DESIGN.md): every
parameter gets a real gradient from every batch, so Adam cannot turn float
noise into a full-lr update and hide real disagreement.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwise


class ParityNet(nn.Module):
    """Embedding + MLP with uneven tensor sizes (one big embedding, small biases)."""

    def __init__(self, vocab: int = 64, dim: int = 16, hidden: int = 24, out: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, out)

    def forward(self, idx: torch.Tensor, target: Optional[torch.Tensor] = None) -> Any:
        h = self.embed(idx).mean(dim=1)
        h = torch.tanh(self.fc1(h))
        h = torch.tanh(self.fc2(h))
        out = self.head(h)
        if target is None:
            return out
        return F.mse_loss(out.float(), target)

    def generate(self, idx: torch.Tensor, steps: int) -> torch.Tensor:
        """A loop calling ``self(...)``, like a HuggingFace model's ``generate``."""
        for _ in range(steps):
            nxt = self(idx[:, -4:]).argmax(dim=-1, keepdim=True)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


def make_model(seed: int = 0, **kwargs: Any) -> ParityNet:
    torch.manual_seed(seed)
    return ParityNet(**kwargs)


def batch(step: int, rank: int, size: int = 4, vocab: int = 64, out: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic data for (step, rank): different on every rank."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(0, vocab, (size, 6), generator=gen)
    target = torch.randn(size, out, generator=gen)
    return idx, target


def params_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in module.named_parameters()}


def train_steps(engine: Any, first: int, steps: int, rank: Optional[int] = None) -> None:
    """Optimizer steps ``first`` to ``first + steps`` of ``engine``, each over its accumulation's micro-batches
    of :func:`batch` (this rank's, or ``rank``'s)."""
    rank = dist.get_rank() if rank is None else rank
    micro = engine.gradient_accumulation_steps()
    for step in range(first * micro, (first + steps) * micro):
        engine.backward(engine(*batch(step, rank)))
        engine.step()


def full_params(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter's full value, as :func:`params_of` (collective at stage 3, where they are gathered)."""
    if engine.strategy.stage != 3:
        return params_of(engine.module)
    with shardwise.zero.GatheredParameters(list(engine.module.parameters())):
        return params_of(engine.module)


def assert_close_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float, rtol: float = 0.0) -> None:
    assert got.keys() == want.keys(), (got.keys(), want.keys())
    for name in want:
        diff = (got[name] - want[name]).abs().max().item()
        assert torch.allclose(got[name], want[name], atol=atol, rtol=rtol), f"{name}: max abs diff {diff:.3g} > atol {atol}"


def ddp_reference(
    steps: int,
    make_opt: Callable[[Any], torch.optim.Optimizer],
    clip: float = 0.0,
    size: int = 4,
    seed: int = 0,
    **model_kwargs: Any,
) -> dict[str, torch.Tensor]:
    """Train a ParityNet with torch DDP for ``steps`` and return its parameters."""
    model = make_model(seed, **model_kwargs)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = make_opt(model.parameters())
    rank = dist.get_rank()
    for step in range(steps):
        idx, target = batch(step, rank, size)
        ddp(idx, target).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return params_of(model)


def adamw(params: Any, lr: float = 1e-2) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)


class FairseqStyleOptimizer:
    """Not a torch Optimizer: holds one inside, as fairseq's optimizers do."""

    def __init__(self, params: Any, make: Callable[[Any], torch.optim.Optimizer] = adamw) -> None:
        self._optimizer = make(params)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._optimizer.param_groups

    @property
    def state(self) -> Any:
        return self._optimizer.state

    def step(self) -> None:
        self._optimizer.step()

    def zero_grad(self) -> None:
        self._optimizer.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state)


def full_params_everywhere(engine: Any) -> dict[str, torch.Tensor]:
    """The engine's full fp32 parameters on every rank (``full_state_dict`` gives rank 0 only)."""
    state = [engine.full_state_dict()]
    dist.broadcast_object_list(state, src=0)
    names = {n for n, _ in engine.module.named_parameters()}
    return {k: v for k, v in state[0].items() if k in names}
