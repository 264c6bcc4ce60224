"""Checkpoints carry the master weights and optimizer state that frozen parameters keep."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _parity import batch, make_model, params_of

import shardwise
from shardwise.testing import distributed_test, run_subtests


def _engine(stage: int, bf16: bool, frozen: bool) -> Any:
    model = make_model()
    if frozen:
        model.fc1.requires_grad_(False)
    config: dict[str, Any] = {"zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}}
    return shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), config)


def _steps(engine: Any, first: int, count: int) -> list[float]:
    losses = []
    for step in range(first, first + count):
        loss = engine(*batch(step, dist.get_rank()))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@distributed_test(world_size=2, timeout=180)
def test_frozen_state_survives_save_and_load(tmp_path: Path) -> None:
    """Train, freeze fc1, train, save; a new engine (fc1 frozen) loads, unfreezes: same as never stopping."""

    def case(stage: int, bf16: bool) -> None:
        where = tmp_path / f"s{stage}-{bf16}"
        straight = _engine(stage, bf16, frozen=False)
        _steps(straight, 0, 2)
        straight.module.fc1.requires_grad_(False)
        _steps(straight, 2, 1)
        straight.module.fc1.requires_grad_(True)
        want = _steps(straight, 3, 2)
        want_params = params_of(straight.module)

        first = _engine(stage, bf16, frozen=False)
        _steps(first, 0, 2)
        first.module.fc1.requires_grad_(False)
        _steps(first, 2, 1)
        first.save_checkpoint(str(where))
        second = _engine(stage, bf16, frozen=True)  # frozen at initialize: holds nothing for fc1
        second.load_checkpoint(str(where))
        second.module.fc1.requires_grad_(True)
        got = _steps(second, 3, 2)
        assert got == want, (stage, bf16, got, want)
        for name, value in params_of(second.module).items():
            assert torch.equal(value, want_params[name]), f"stage {stage} bf16 {bf16}: {name} differs"
        for engine in (straight, first, second):
            engine.destroy()

    run_subtests(case, [{"stage": s, "bf16": b} for s in (0, 1, 2, 3) for b in (False, True)])
