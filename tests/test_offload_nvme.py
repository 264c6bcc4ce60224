"""Optimizer offload to NVMe at stages 1-2 (``offload_optimizer: {device: nvme}``; docs/offload.md).

Same math: over 20 steps on 2 ranks, with accumulation and clipping, an offloaded engine trains to the
weights the same stage trains without offload (fp32, atol 1e-6; the step is torch's own over the same
fp32 values, so they agree to the bit here).  Its checkpoints load into a plain engine and back, and
reshard from 2 ranks to 1; two offloaded engines on one ``nvme_path`` keep apart.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from _parity import assert_close_params, make_model, params_of, train_steps

import shardwise
from shardwise.testing import distributed_test, run_distributed, run_subtests

#: small enough that the parity model's shard spans several sub-groups, a piece larger than it included
SUB_GROUP = 300
ATOL = 1e-6


def _config(stage: int, nvme: Optional[str], micro: int = 2, bf16: bool = False) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 500}
    if nvme is not None:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": 2}
        zero["sub_group_size"] = SUB_GROUP
    return {"zero_optimization": zero, "gradient_accumulation_steps": micro, "gradient_clipping": 0.5,
            "checkpoint": {"timeout": 30}, "bf16": {"enabled": bf16}}


def _engine(stage: int, nvme: Optional[str], micro: int = 2, bf16: bool = False) -> Any:
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return shardwise.initialize(model, optimizer, _config(stage, nvme, micro, bf16))


def _parity_case(stage: int, nvme: str, bf16: bool = False) -> None:
    plain = _engine(stage, None, bf16=bf16)
    train_steps(plain, 0, 20)
    offloaded = _engine(stage, nvme, bf16=bf16)
    masters = offloaded.strategy.store.home
    folder = masters.files.folder
    train_steps(offloaded, 0, 20)
    assert_close_params(params_of(offloaded.module), params_of(plain.module), atol=ATOL)
    assert not offloaded.optimizer.inner.state, "optimizer state stays on disk between steps"
    # the embedding's piece (512 elements a rank) is cut across sub-groups: none is larger than asked
    # (but for a bucket's padding, fewer elements than ranks)
    largest = max(g.numel for g in masters.stepper.groups)
    assert largest <= SUB_GROUP + 1 and len(masters.stepper.groups) >= 4, [g.numel for g in masters.stepper.groups]
    held = masters.pool.nbytes()  # fp32 master and Adam's two moments, each region 64-byte aligned
    assert 0 < held <= masters.spec.buffer_count * (largest * 12 + 4 * 64), (held, largest)
    offloaded.destroy()
    plain.destroy()
    assert not folder.exists(), f"{folder} left after destroy"


@distributed_test(world_size=2, timeout=240)
def test_nvme_offload_trains_as_the_same_stage_without_it(tmp_path: Path) -> None:
    cases = [{"stage": 1, "nvme": str(tmp_path)}, {"stage": 2, "nvme": str(tmp_path)},
             {"stage": 2, "nvme": str(tmp_path), "bf16": True}]  # bf16: fp32 masters on disk, cast when published
    run_subtests(_parity_case, cases)  # ends at a barrier
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


def _round_trip(root: str) -> None:
    """Offloaded -> plain and plain -> offloaded, with two offloaded engines alive on one nvme_path."""
    nvme = str(Path(root) / "nvme")
    first = _engine(2, nvme)
    second = _engine(1, nvme)  # same nvme_path, alive at once: its own folder
    assert first.strategy.store.home.files.folder != second.strategy.store.home.files.folder
    train_steps(first, 0, 3)
    train_steps(second, 0, 3)
    first.save_checkpoint(str(Path(root) / "offloaded"), tag="a")
    plain = _engine(1, None)
    plain.load_checkpoint(str(Path(root) / "offloaded"), tag="a")
    assert_close_params(params_of(plain.module), params_of(first.module), atol=0.0)
    for engine in (first, second, plain):
        train_steps(engine, 3, 3)
    # the plain engine resumed the offloaded one's masters and Adam state exactly
    assert_close_params(params_of(plain.module), params_of(first.module), atol=ATOL)
    assert_close_params(params_of(second.module), params_of(first.module), atol=ATOL)
    plain.save_checkpoint(str(Path(root) / "plain"), tag="b")
    back = _engine(2, nvme)
    back.load_checkpoint(str(Path(root) / "plain"), tag="b")
    for engine in (back, plain):
        train_steps(engine, 6, 3)
    assert_close_params(params_of(back.module), params_of(plain.module), atol=ATOL)
    for engine in (first, second, plain, back):
        engine.destroy()
    dist.barrier()  # every rank has destroyed its engines
    assert os.listdir(nvme) == [], os.listdir(nvme)


@distributed_test(world_size=2, timeout=240)
def test_offloaded_checkpoints_load_into_a_plain_engine_and_back(tmp_path: Path) -> None:
    _round_trip(str(tmp_path))


def _save_offloaded(root: str) -> None:
    engine = _engine(2, str(Path(root) / "nvme"), micro=1)
    train_steps(engine, 0, 3)
    engine.save_checkpoint(str(Path(root) / "two"), tag="t")
    engine.destroy()


def test_a_checkpoint_of_two_offloaded_ranks_reshards_onto_one(tmp_path: Path) -> None:
    """Saved by 2 offloaded ranks, loaded by 1 rank with and without offload: same weights, same next step."""
    run_distributed(_save_offloaded, 2, args=(str(tmp_path),), timeout=180)
    engines = [_engine(1, str(tmp_path / "nvme1"), micro=1), _engine(1, None, micro=1)]
    for engine in engines:
        engine.load_checkpoint(str(tmp_path / "two"), tag="t")
    assert_close_params(params_of(engines[0].module), params_of(engines[1].module), atol=0.0)
    for engine in engines:
        train_steps(engine, 3, 2, rank=0)
    assert_close_params(params_of(engines[0].module), params_of(engines[1].module), atol=ATOL)
    for engine in engines:
        engine.destroy()


def _freeze_and_thaw(nvme: Optional[str]) -> dict[str, torch.Tensor]:
    engine = _engine(2, nvme, micro=1)
    for step in range(9):
        if step in (3, 6):  # fc1.weight stops training, then trains again: its master and Adam state carried
            engine.module.fc1.weight.requires_grad_(step == 6)
        train_steps(engine, step, 1, rank=0)
    params = params_of(engine.module)
    engine.destroy()
    return params


def test_a_change_of_the_trainable_set_carries_the_offloaded_state(tmp_path: Path) -> None:
    """One process: freezing and unfreezing a parameter rebuilds the offloaded masters as it does the others."""
    assert_close_params(_freeze_and_thaw(str(tmp_path)), _freeze_and_thaw(None), atol=ATOL)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_sub_group_step_gives_every_buffer_back() -> None:
    """A step that raises part-way (an I/O error, a bad state) leaves the pool whole: the next step and
    `memory_breakdown` (which counts the free buffers) do not wait forever on a buffer that never returns."""
    from shardwise.zero.store.subgroups import BufferPool, pipelined

    pool = BufferPool(3, 64)

    def read(index: int, buffer: torch.Tensor) -> None:
        buffer.fill_(index)

    def failing(index: int, buffer: torch.Tensor) -> Any:
        if index == 1:
            raise OSError("injected: the disk went away")
        return lambda: None

    try:
        pipelined([0, 1, 2, 3, 4], [64] * 5, pool, read, failing)
        raise AssertionError("the injected error did not surface")
    except OSError as error:
        assert "injected" in str(error)
    assert pool.nbytes() == 3 * 64  # all three buffers are back (before the fix this call blocked forever)
    pipelined([0, 1, 2], [64] * 3, pool, read, lambda index, buffer: (lambda: None))
