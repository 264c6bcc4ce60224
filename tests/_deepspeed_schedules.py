"""The cases behind ``tests/fixtures/deepspeed/schedules.json`` (see ``make_schedules.py`` there).

Shared by the generator (run with DeepSpeed installed) and ``tests/test_deepspeed_schedules.py``
(which does not need DeepSpeed): both build the same configs and force the same overflows.
"""

from __future__ import annotations

import json
from typing import Any

import _deepspeed_fixture as fx

STEPS = 10  # optimizer steps per case
#: a loss this many times larger overflows fp16 gradients at any loss scale >= 1
OVERFLOW_FACTOR = 1e30

#: case -> DeepSpeed `scheduler` section (fp32, ZeRO stage 0, the fixture's AdamW at lr 0.02)
SCHEDULE_CASES: dict[str, dict[str, Any]] = {
    "WarmupLR": {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.001, "warmup_max_lr": 0.02, "warmup_num_steps": 4, "warmup_type": "linear"}},
    "WarmupDecayLR": {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 8, "warmup_min_lr": 0.002, "warmup_max_lr": 0.02, "warmup_num_steps": 3,
        "warmup_type": "log"}},
    "WarmupCosineLR": {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 8, "warmup_min_ratio": 0.1, "warmup_num_steps": 3, "cos_min_ratio": 0.05,
        "warmup_type": "linear"}},
}

#: case -> (ZeRO stage, `fp16` section, steps at which rank 1's loss overflows). DeepSpeed's stage 0
#: (its FP16_Optimizer) has no hysteresis; stages 1-3 (its DynamicLossScaler) do.
SCALE_CASES: dict[str, tuple[int, dict[str, Any], tuple[int, ...]]] = {
    "fp16_window2": (0, {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}, ()),
    "fp16_overflow_z0": (0, {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}, (3, 4, 8)),
    # hysteresis 2: the first overflow only spends credit, the second (next step) halves the scale
    "fp16_overflow_z1": (1, {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}, (3, 4, 8)),
    "fp16_consecutive_z2": (2, {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 3,
                                "hysteresis": 2, "consecutive_hysteresis": True}, (2, 4, 5)),
}


def schedule_config(name: str) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": fx.MICRO_BATCH, "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0, "zero_optimization": {"stage": 0}, "scheduler": SCHEDULE_CASES[name]}


def scale_config(name: str) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": fx.MICRO_BATCH, "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0, "zero_optimization": {"stage": SCALE_CASES[name][0]}, "fp16": SCALE_CASES[name][1]}


def loss_factor(name: str, step: int, rank: int) -> float:
    """What rank `rank` multiplies its loss by at `step` (0-based) before backward."""
    return OVERFLOW_FACTOR if rank == 1 and step in SCALE_CASES[name][2] else 1.0


def record(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((fx.FIXTURES / "schedules.json").read_text())[name]
    return data


def train_schedule(deepspeed: Any, name: str, rank: int) -> tuple[list[list[float]], list[float], Any]:
    """The client loop both tools run, as an imports-only port would: ``deepspeed`` is DeepSpeed itself (the
    generator) or ``shardwise.deepspeed`` (the test).  Returns the lr of every group before each step, this
    rank's losses, and the engine."""
    model = fx.Tiny()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=fx.optimizer(model),
                                           config=schedule_config(name))
    lrs, losses = [], []
    for k in range(STEPS):
        lrs.append([float(lr) for lr in engine.get_lr()])
        x, y = fx.batch(k, rank)
        loss = fx.loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.item()))
    return lrs, losses, engine
