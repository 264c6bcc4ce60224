"""``to_sequential()`` trained by a plain engine at every ZeRO stage on 2 ranks, against one process.

Tolerance 1e-5 on losses and parameters (fp32; the same math as one process
on the global batch).  Stage 3 with activation checkpointing is the case no
other test covers: recomputation in backward runs the layers' forwards again,
and the stage-3 hooks must gather their parameters again.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _pipe_models import assert_close, micro_batches, pipeline, reference_run, tied_layers

import shardwise
from shardwise.testing import distributed_test, run_subtests

ATOL = 1e-5


class _Counter:
    """A layer that counts its calls (forward, and recomputation in backward)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x


def _case(zero: int, checkpoint: int) -> None:
    steps, accumulation = 3, 2
    counter = _Counter()
    layers = tied_layers(depth=4)
    layers.insert(2, counter)
    model = pipeline(layers, activation_checkpoint_interval=checkpoint).to_sequential()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": {"stage": zero, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
    }
    engine = shardwise.initialize(model, config=config)
    rank, losses = dist.get_rank(), []
    for step in range(steps):
        total = torch.zeros(())
        for x, y in micro_batches((step * 2 + rank) * accumulation, accumulation):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / (2 * accumulation)
        dist.all_reduce(total)
        losses.append(total.item())
    # the counter leads a chunk [counter, Linear] at interval 2: recomputing the Linear's input runs it again
    # (alone in a chunk at interval 1 it saves nothing, so nothing is recomputed)
    runs = steps * accumulation
    assert counter.calls == (2 * runs if checkpoint == 2 else runs), counter.calls
    want_losses, want = reference_run(layers, steps, accumulation, replicas=2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=0, atol=ATOL)
    state = engine.full_state_dict()
    if rank == 0:
        assert_close(state, want, ATOL)
    engine.destroy()


@distributed_test(world_size=2, timeout=300)
def test_to_sequential_trains_at_every_zero_stage() -> None:
    cases: list[dict[str, Any]] = [{"zero": z, "checkpoint": 0} for z in (0, 1, 2, 3)]
    cases += [{"zero": 2, "checkpoint": 2}, {"zero": 3, "checkpoint": 1}, {"zero": 3, "checkpoint": 2}]
    run_subtests(_case, cases)
