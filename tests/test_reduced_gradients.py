"""The reduced gradient itself, at every stage, against one process.

AdamW divides each update by the root of its second moment, so a gradient off
by a constant factor (summed instead of averaged over ranks, or averaged twice)
moves AdamW's weights by only ~6e-5 in five steps. Plain SGD with ``lr = 1``
and no momentum turns an update into the gradient itself: ``before - after``
is the averaged gradient the engine applied, compared element by element with
the gradient one process computes on both ranks' batches. The global gradient
norm the engine reports is checked against the same reference.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from _parity import assert_close_params, batch, full_params_everywhere, make_model, params_of
from torch import nn

import shardwise
from shardwise.testing import distributed_test, run_subtests

STEPS = 3
WORLD = 2
#: |weights| < 1 in fp32 carry ~6e-8 rounding, so ``before - after`` recovers a gradient to ~1e-7;
#: a factor-of-two slip changes gradients of ~1e-2 by ~1e-2
GRAD_ATOL = 1e-6


def _one_process_step(model: nn.Module, step: int, micro: int) -> tuple[dict[str, torch.Tensor], float]:
    """Both ranks' micro-batches in this process (the mean of their losses): gradients and their norm."""
    losses = [model(*batch(step * micro + m, rank)) for rank in range(WORLD) for m in range(micro)]
    (sum(losses) / len(losses)).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param -= grads[name]  # SGD, lr 1: the same update as the engine's
    model.zero_grad(set_to_none=True)
    return grads, norm


def _case(stage: int, micro: int) -> None:
    reference = make_model()
    model = make_model()
    zero = {"stage": stage, "reduce_bucket_size": 400, "stage3_param_persistence_threshold": 0}
    config = {"gradient_accumulation_steps": micro, "zero_optimization": zero}
    engine = shardwise.initialize(model, torch.optim.SGD(model.parameters(), lr=1.0), config)
    rank = dist.get_rank()
    for step in range(STEPS):
        before = full_params_everywhere(engine)
        for m in range(micro):
            engine.backward(engine(*batch(step * micro + m, rank)))
            engine.step()
        after = full_params_everywhere(engine)
        want, want_norm = _one_process_step(reference, step, micro)
        applied = {name: before[name] - after[name] for name in before}
        assert_close_params(applied, want, atol=GRAD_ATOL)
        norm = engine.get_global_grad_norm()
        assert norm is not None and math.isclose(norm, want_norm, rel_tol=1e-5), (
            f"step {step}: global gradient norm {norm} != one process's {want_norm}"
        )
    # and the weights themselves, after every step's rounding
    assert_close_params(full_params_everywhere(engine), params_of(reference), atol=GRAD_ATOL)
    engine.destroy()


@distributed_test(world_size=WORLD, timeout=180)
def test_reduced_gradient_equals_one_process_at_every_stage() -> None:
    run_subtests(_case, [{"stage": s, "micro": m} for s in (0, 1, 2, 3) for m in (1, 2)])
