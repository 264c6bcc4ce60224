"""`shardwise.deepspeed` steps its lr schedules and dynamic loss scale as DeepSpeed 0.19.8 does.

Replays tests/fixtures/deepspeed/schedules.json (recorded from DeepSpeed by make_schedules.py there,
2 gloo ranks, the tiny model of _deepspeed_fixture.py) on 2 ranks without DeepSpeed.

Schedules (fp32, ZeRO 0): the lr of every group before each of 10 optimizer steps equals DeepSpeed's
to 1e-12 (the same closed forms; measured 0 or one rounding), and every rank's loss to 1e-6 relative
(measured below 1e-6: the same fp32 math; the losses depend on the lrs, so a one-step lag shows).

Loss scale (fp16): the scale after each step and which steps were skipped equal DeepSpeed's exactly,
with rank 1's loss overflowing at given steps, at ZeRO 0 (DeepSpeed: no hysteresis there) and 1-2
(hysteresis, with and without `consecutive_hysteresis`). Losses are not compared: DeepSpeed's fp16
on CPU departs from its own fp32 run (see test_deepspeed_checkpoint.py).
"""

from __future__ import annotations

import _deepspeed_fixture as fx
import _deepspeed_schedules as cases
import pytest
import torch
import torch.distributed as dist

import shardwise
import shardwise.deepspeed as deepspeed
from shardwise.optim.schedulers import WarmupCosineLR, WarmupLR
from shardwise.testing import distributed_test

LR_TOLERANCE = 1e-12  # absolute
LOSS_TOLERANCE = 1e-6  # relative


def _schedule_run(name: str) -> tuple[list[list[float]], list[float]]:
    lrs, losses, engine = cases.train_schedule(deepspeed, name, dist.get_rank())
    engine.destroy()
    return lrs, losses


def _scale_run(name: str, dialect: bool) -> tuple[list[float], list[bool]]:
    model = fx.Tiny()
    config = cases.scale_config(name)
    if dialect:
        engine = deepspeed.initialize(model=model, optimizer=fx.optimizer(model), config=config)[0]
    else:
        engine = shardwise.initialize(model, fx.optimizer(model), config)
    scales, skipped = [], []
    for k in range(cases.STEPS):
        x, y = fx.batch(k, dist.get_rank())
        loss = fx.loss_fn(engine(x), y)
        engine.backward(loss * cases.loss_factor(name, k, dist.get_rank()))
        skipped.append(not engine.step())
        scales.append(engine.loss_scale)
    engine.destroy()
    return scales, skipped


@distributed_test(world_size=2, timeout=240)
def test_schedules_follow_deepspeed_on_two_ranks() -> None:
    rank = dist.get_rank()
    for name in cases.SCHEDULE_CASES:
        record = cases.record(name)
        lrs, losses = _schedule_run(name)
        gaps = [abs(g - w) for got, want in zip(lrs, record["lrs"]) for g, w in zip(got, want)]
        assert len(lrs) == len(record["lrs"]) and max(gaps) <= LR_TOLERANCE, \
            f"rank {rank} {name}: lrs {lrs} vs DeepSpeed's {record['lrs']}"
        want = [step[rank] for step in record["losses"]]
        errors = [abs(g - w) / abs(w) for g, w in zip(losses, want)]
        assert max(errors) <= LOSS_TOLERANCE, f"rank {rank} {name}: losses {losses} vs DeepSpeed's {want}"

    _continues_a_deepspeed_checkpoint(rank)


def _continues_a_deepspeed_checkpoint(rank: int) -> None:
    """A dialect engine (schedule started as DeepSpeed's) loading a DeepSpeed checkpoint continues with
    DeepSpeed's lrs and losses (the checkpoint stores `last_batch_iteration` 3 after 4 steps)."""
    record = fx.record("z0_fp32")
    model = fx.Tiny()
    engine = deepspeed.initialize(model=model, optimizer=fx.optimizer(model), config=fx.config(0, "fp32"))[0]
    engine.load_checkpoint(fx.FIXTURES / "z0_fp32")
    lrs, losses = [], []
    for k in range(fx.SAVE_AFTER, fx.SAVE_AFTER + fx.CONTINUE):
        lrs.append(engine.get_lr())
        x, y = fx.batch(k, rank)
        loss = fx.loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert lrs == record["lrs"], f"rank {rank}: lrs after loading {lrs} vs DeepSpeed's {record['lrs']}"
    want = [step[rank] for step in record["after"]]
    assert max(abs(g - w) / abs(w) for g, w in zip(losses, want)) <= LOSS_TOLERANCE, (losses, want)
    engine.destroy()


@distributed_test(world_size=2, timeout=240)
def test_loss_scale_follows_deepspeed_with_overflows_on_two_ranks() -> None:
    rank = dist.get_rank()
    for name, (stage, _, _) in cases.SCALE_CASES.items():
        record = cases.record(name)
        # DeepSpeed's window rule holds in both dialects; its stage-0 lack of hysteresis only in the dialect.
        for dialect in (True, False) if stage > 0 or name == "fp16_window2" else (True,):
            scales, skipped = _scale_run(name, dialect)
            assert (scales, skipped) == (record["scales"], record["skipped"]), \
                f"rank {rank} {name} (dialect {dialect}): scales {scales}, skipped {skipped} vs DeepSpeed's " \
                f"{record['scales']}, {record['skipped']}"


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.5)


@pytest.mark.parametrize("deepspeed_start", [False, True])
def test_a_loaded_state_continues_at_its_lr_whichever_way_the_schedule_started(deepspeed_start: bool) -> None:
    reference = WarmupLR(_optimizer(), 0.0, 1.0, warmup_num_steps=10, warmup_type="linear")
    for _ in range(3):
        reference.step()
    resumed = WarmupLR(_optimizer(), 0.0, 1.0, warmup_num_steps=10, warmup_type="linear",
                       deepspeed_start=deepspeed_start)
    resumed.load_state_dict({"last_batch_iteration": 3})  # DeepSpeed's format: the iteration alone
    assert resumed.get_last_lr() == reference.get_last_lr() == [0.3]
    resumed.step()
    assert resumed.get_last_lr() == [0.4]


def test_deepspeed_start_writes_iteration_minus_one() -> None:
    warm = WarmupLR(_optimizer(), 0.1, 1.0, warmup_num_steps=10, warmup_type="linear", deepspeed_start=True)
    assert (warm.last_batch_iteration, warm.get_last_lr()) == (-1, [0.1])
    cosine = WarmupCosineLR(_optimizer(), 20, warmup_min_ratio=0.5, warmup_num_steps=4, deepspeed_start=True)
    assert cosine.get_last_lr() == [0.0]  # DeepSpeed 0.19 writes 0, not warmup_min_ratio x lr
    cosine.step()
    assert cosine.get_last_lr() == [0.25]
    plain = WarmupCosineLR(_optimizer(), 20, warmup_min_ratio=0.5, warmup_num_steps=4)
    assert (plain.last_batch_iteration, plain.get_last_lr()) == (0, [0.25])
