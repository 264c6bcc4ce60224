"""Models written as pipeline layers, shared by the pipeline tests.

``tied_layers()`` has a tied embedding (first layer) reused as the output head
(last layer): with two stages the key spans both.  Every parameter gets a
real gradient (see DESIGN.md on parity models).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.pipe import LayerSpec, PipelineModule, TiedLayerSpec

VOCAB, DIM = 32, 12


def head(embedding: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The tied output head: logits from the embedding's weight."""
    return F.linear(x, embedding.weight)


def pool(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=1)


class Scale(nn.Module):
    """Multiplies by a learned vector; ``forward`` is also used as a bound method."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class Carry(nn.Module):
    """Takes ``(hidden, ids)`` and returns ``(new hidden, ids)``: a tuple activation with an
    integer tensor that needs no gradient."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, ids = pair
        return torch.tanh(self.fc(hidden)) + 0.01 * ids.float().mean(1, keepdim=True), ids


def tied_layers(depth: int = 4) -> list[Any]:
    """Embedding → pool → ``depth`` × (Linear, tanh) → tied head."""
    layers: list[Any] = [TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM), pool]
    for _ in range(depth):
        layers += [LayerSpec(nn.Linear, DIM, DIM), torch.tanh]
    return layers + [TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=head)]


def tuple_layers() -> list[Any]:
    """Activations that are tuples ``(hidden, ids)`` between the embedding and the head."""
    return [
        lambda ids: (ids, ids),
        lambda pair: (F.embedding(pair[0], torch.ones(VOCAB, DIM)).mean(1), pair[1]),
        LayerSpec(Carry),
        LayerSpec(Carry),
        LayerSpec(Carry),
        lambda pair: pair[0],
        LayerSpec(nn.Linear, DIM, VOCAB),
    ]


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels)


def pipeline(layers: list[Any], num_stages: int = 1, **kwargs: Any) -> PipelineModule:
    """Seeded per layer, so any stage builds a layer exactly as one process does."""
    return PipelineModule(layers, num_stages=num_stages, loss_fn=cross_entropy, seed_layers=True, **kwargs)


def micro_batch(index: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7919 * index + 1)
    return torch.randint(0, VOCAB, (size, 5), generator=gen), torch.randint(0, VOCAB, (size,), generator=gen)


def micro_batches(start: int, count: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    return (micro_batch(i) for i in range(start, start + count))


def reference_run(
    layers: list[Any], steps: int, accumulation: int, replicas: int = 1, clip: float = 0.0, lr: float = 1e-2, **kwargs: Any
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process: ``steps`` AdamW steps, each averaging ``accumulation × replicas`` micro-batches
    (replica ``r`` of step ``s`` takes micro-batches from ``(s × replicas + r) × accumulation``)."""
    model = pipeline(layers, **kwargs).to_sequential()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    losses = []
    for step in range(steps):
        total = 0.0
        for replica in range(replicas):
            for x, y in micro_batches((step * replicas + replica) * accumulation, accumulation):
                loss = model(x, y)
                (loss / (accumulation * replicas)).backward()
                total += loss.item() / (accumulation * replicas)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float) -> None:
    """Every entry of ``got`` within ``atol`` of ``want`` (``got`` may be a subset: one stage)."""
    assert got, "nothing to compare"
    for name, value in got.items():
        diff = (value.float() - want[name].float()).abs().max().item()
        assert diff <= atol, f"{name}: max abs diff {diff:.3g} > {atol}"


class Shift(nn.Module):
    """Adds a persistent buffer: state that is not a parameter, written by rank 0 in checkpoints."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.register_buffer("offset", torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.offset
