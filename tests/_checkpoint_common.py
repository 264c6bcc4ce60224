"""Shared pieces of the checkpoint tests: engines, training, and full (unsharded) views of state."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _parity import ParityNet, adamw, batch, make_model
from torch import nn

import shardwise


def config(stage: int, **sections: Any) -> dict[str, Any]:
    """A config for ``stage`` with small buckets, so parameters split across ranks at odd offsets."""
    cfg: dict[str, Any] = {
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "stage3_param_persistence_threshold": 0},
        "checkpoint": {"timeout": 60},
    }
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return cfg


def build(stage: int, seed: int = 0, model: nn.Module | None = None, frozen: tuple[str, ...] = (), **sections: Any) -> Any:
    """An engine at ``stage`` over ParityNet (or ``model``) with the parameters named in ``frozen`` frozen."""
    model = model if model is not None else make_model(seed)
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    return shardwise.initialize(model, adamw(model.parameters()), config(stage, **sections))


def train(engine: Any, start: int, steps: int) -> list[float]:
    """``steps`` steps on the deterministic batches ``start, start+1, ...``; the losses."""
    losses = []
    rank = dist.get_rank()
    for step in range(start, start + steps):
        idx, target = batch(step, rank)
        loss = engine(idx, target)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def full_params(engine: Any) -> dict[str, torch.Tensor]:
    """Every trainable parameter's full fp32 master value, by name, on every rank (collective)."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    return {names[k]: v.detach().cpu() for k, v in engine.strategy.full_master_weights().items() if k in names}


def full_optimizer_state(engine: Any) -> dict[str, dict[str, Any]]:
    """Every parameter's optimizer state put together from all ranks' pieces (collective)."""
    pieces = []
    with engine.checkpointable().shards(loading=False) as shards:
        for shard in shards:
            entries = shard.state.get().items()
            state = {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in entries}
            pieces.append((shard.name, list(shard.shape), shard.start, shard.end, state))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, pieces)
    full: dict[str, dict[str, Any]] = {}
    for name, shape, start, end, state in (p for rank_pieces in everyone for p in rank_pieces):
        entry = full.setdefault(name, {})
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == end - start:
                flat = entry.setdefault(key, torch.full((torch.Size(shape).numel(),), float("nan"), dtype=value.dtype))
                flat[start:end] = value.reshape(-1)
            else:
                entry[key] = value
    return full


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Bit-identical nested dicts of tensors and plain values."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for key in want:
            assert_same(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__} is not a tensor"
        assert got.dtype == want.dtype and got.shape == want.shape, (
            f"{where}: {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"
        )
        assert torch.equal(got, want), f"{where}: max abs diff {(got.double() - want.double()).abs().max().item():.3g}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def snapshot(engine: Any) -> dict[str, Any]:
    """Full parameters and optimizer state (collective)."""
    return {"params": full_params(engine), "optim": full_optimizer_state(engine)}


class TiedNet(nn.Module):
    """Embedding and output head sharing one weight (two ``state_dict`` names, one tensor), plus a buffer."""

    def __init__(self, vocab: int = 64, dim: int = 16, out: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.proj = nn.Linear(vocab, out)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(self.embed(idx).mean(dim=1)))
        out = self.proj(self.head(h)) * self.scale
        return torch.nn.functional.mse_loss(out.float(), target)


def tied_model(seed: int = 0) -> TiedNet:
    torch.manual_seed(seed)
    return TiedNet()


class NoisyNet(ParityNet):
    """ParityNet with dropout: how it trains depends on each rank's RNG state, which a resume must restore."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.25)

    def forward(self, idx: torch.Tensor, target: torch.Tensor | None = None) -> Any:
        h = self.drop(self.embed(idx).mean(dim=1))
        h = self.drop(torch.tanh(self.fc1(h)))
        out = self.head(torch.tanh(self.fc2(h)))
        return out if target is None else nn.functional.mse_loss(out.float(), target)


def noisy_model(seed: int = 0) -> NoisyNet:
    torch.manual_seed(seed)
    return NoisyNet()
