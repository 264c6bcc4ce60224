"""Several engines in one process, each with its own config: side by side, compared with references."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _parity import adamw, assert_close_params, batch, full_params_everywhere, make_model, params_of
from torch import nn

import shardwise
from shardwise.checkpoint import CheckpointError
from shardwise.testing import distributed_test, run_subtests


def _step(engine: Any, step: int, offset: int) -> float:
    loss = engine(*batch(step + offset, dist.get_rank()))
    engine.backward(loss)
    engine.step()
    return float(loss.item())


def _ddp(seed: int, offset: int, steps: int, group: Optional[dist.ProcessGroup] = None) -> dict[str, torch.Tensor]:
    """The same model trained alone with torch DDP over ``group`` (data offset as the engine's)."""
    model = make_model(seed)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
    opt = adamw(model.parameters())
    for step in range(steps):
        ddp(*batch(step + offset, dist.get_rank())).backward()
        opt.step()
        opt.zero_grad()
    return params_of(model)


@distributed_test(world_size=2, timeout=180)
def test_two_trained_engines_at_stages_1_and_3() -> None:
    a_model, b_model = make_model(0), make_model(1)
    a = shardwise.initialize(a_model, adamw(a_model.parameters()), {"zero_optimization": {"stage": 1}}, name="a")
    b = shardwise.initialize(b_model, adamw(b_model.parameters()), {"zero_optimization": {"stage": 3}}, name="b")
    for step in range(4):  # interleaved, as a GAN or a policy/value pair would train
        _step(a, step, 0)
        _step(b, step, 100)
    assert_close_params(full_params_everywhere(a), _ddp(0, 0, 4), atol=1e-5)
    assert_close_params(full_params_everywhere(b), _ddp(1, 100, 4), atol=1e-5)
    a.destroy()
    b.destroy()


_PRECISIONS: dict[str, dict[str, Any]] = {
    # a scale of 2^24 overflows fp16 gradients: the first steps are skipped (hysteresis 2)
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 24}, "zero_optimization": {"stage": 1}},
    "bf16": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}},
    "fp32": {"zero_optimization": {"stage": 0}},
}


def _build(kind: str) -> Any:
    model = make_model(3)
    return shardwise.initialize(model, adamw(model.parameters()), _PRECISIONS[kind], name=kind)


@distributed_test(world_size=2, timeout=180)
def test_fp16_bf16_fp32_engines_together_each_own_scaler() -> None:
    alone: dict[str, dict[str, torch.Tensor]] = {}
    for kind in _PRECISIONS:
        engine = _build(kind)
        for step in range(4):
            _step(engine, step, 0)
        alone[kind] = full_params_everywhere(engine)
        engine.destroy()
    together = {kind: _build(kind) for kind in _PRECISIONS}
    for step in range(4):
        for engine in together.values():
            _step(engine, step, 0)
    assert together["fp16"].skipped_steps >= 2, "the fp16 engine must overflow for this test to mean anything"
    assert together["bf16"].skipped_steps == 0 and together["fp32"].skipped_steps == 0, "an overflow crossed engines"
    assert together["fp16"].loss_scale < 2.0**24 and together["bf16"].loss_scale == 1.0
    for kind, engine in together.items():  # bit-identical to training alone
        assert_close_params(full_params_everywhere(engine), alone[kind], atol=0.0)
        engine.destroy()


def _teacher_reference(seed: int) -> nn.Module:
    teacher = make_model(seed)
    return teacher.to(torch.bfloat16).eval()


def _distill_loss(student_out: torch.Tensor, teacher_out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(student_out, target) + F.mse_loss(student_out, teacher_out.float())


@distributed_test(world_size=2, timeout=180)
def test_distillation_student_matches_one_process(tmp_path: Any) -> None:
    """A bf16 ZeRO-3 teacher (inference-only, built partitioned, loaded from a file) and an fp32 ZeRO-2 student."""
    if dist.get_rank() == 0:
        torch.save(make_model(9).state_dict(), tmp_path / "teacher.pt")
    dist.barrier()
    teacher_config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    with shardwise.zero.Init(config=teacher_config):
        teacher_model = make_model(0)
    shardwise.zero.load_state_dict(teacher_model, tmp_path / "teacher.pt")
    teacher = shardwise.initialize(teacher_model, None, teacher_config, name="teacher")
    student_model = make_model(2)
    student = shardwise.initialize(student_model, adamw(student_model.parameters()),
                                   {"zero_optimization": {"stage": 2}}, name="student")
    for step in range(4):
        idx, target = batch(step, dist.get_rank())
        with torch.no_grad():
            soft = teacher(idx)
        student.backward(_distill_loss(student(idx), soft, target))
        student.step()

    # the same on one process: a plain bf16 teacher, a DDP student (gradients averaged like the engine's)
    reference_teacher = make_model(9).to(torch.bfloat16).eval()
    reference = make_model(2)
    ddp = nn.parallel.DistributedDataParallel(reference)
    opt = adamw(reference.parameters())
    for step in range(4):
        idx, target = batch(step, dist.get_rank())
        with torch.no_grad():
            soft = reference_teacher(idx)
        _distill_loss(ddp(idx), soft, target).backward()
        opt.step()
        opt.zero_grad()
    assert_close_params(full_params_everywhere(student), params_of(reference), atol=1e-5)
    student.destroy()
    teacher.destroy()


@distributed_test(world_size=2, timeout=180)
def test_misuse_gets_clear_errors() -> None:
    def shared_module() -> None:
        model = make_model()
        first = shardwise.initialize(model, adamw(model.parameters()), {}, name="first")
        with pytest.raises(ValueError, match="already belongs to engine `first`"):
            shardwise.initialize(model, adamw(model.parameters()), {"zero_optimization": {"stage": 2}}, name="second")
        first.destroy()
        again = shardwise.initialize(model, adamw(model.parameters()), {}, name="again")  # destroy let go
        again.destroy()

    def foreign_optimizer() -> None:
        a_model, b_model = make_model(0), make_model(1)
        a = shardwise.initialize(a_model, adamw(a_model.parameters()), {}, name="a")
        with pytest.raises(ValueError, match="they are parameters of engine `a`"):
            shardwise.initialize(b_model, adamw(a_model.parameters()), {}, name="b")
        a.destroy()

    def wrong_backward() -> None:
        a_model, b_model = make_model(0), make_model(1)
        a = shardwise.initialize(a_model, adamw(a_model.parameters()), {}, name="a")
        b = shardwise.initialize(b_model, adamw(b_model.parameters()), {"zero_optimization": {"stage": 3}}, name="b")
        loss = a(*batch(0, dist.get_rank()))
        with pytest.raises(RuntimeError, match="reached none of its .* trainable parameter"):
            b.backward(loss)
        a.destroy()
        b.destroy()

    run_subtests(lambda case: case(), [{"case": f} for f in (shared_module, foreign_optimizer, wrong_backward)])


@distributed_test(world_size=2, timeout=120)
def test_engines_built_in_different_orders_fail_on_every_rank() -> None:
    names = ["x", "y"] if dist.get_rank() == 0 else ["y", "x"]
    model = make_model()
    with pytest.raises(CheckpointError, match=r"different engine names \(rank 0: 'x', rank 1: 'y'\)"):
        shardwise.initialize(model, adamw(model.parameters()), {"checkpoint": {"timeout": 20}}, name=names[0])


@distributed_test(world_size=4, timeout=240)
def test_engine_on_a_subgroup_next_to_one_on_the_world() -> None:
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    mine = pairs[rank // 2]
    pair_model, world_model = make_model(4), make_model(5)
    pair = shardwise.initialize(pair_model, adamw(pair_model.parameters()), {"zero_optimization": {"stage": 2}},
                                process_group=mine, name="pair")
    world = shardwise.initialize(world_model, adamw(world_model.parameters()), {"zero_optimization": {"stage": 1}},
                                 name="world")
    assert (pair.comm.world_size, world.comm.world_size) == (2, 4)
    for step in range(3):
        _step(pair, step, 10)
        _step(world, step, 20)
    # Each equals DDP over its own group: had a collective crossed groups, the averages would differ.
    assert_close_params(params_of(pair_model), _ddp(4, 10, 3, group=mine), atol=1e-5)
    assert_close_params(params_of(world_model), _ddp(5, 20, 3), atol=1e-5)
    pair.destroy()
    world.destroy()
