"""Stage 0 (plain data parallel): parity with torch DDP and the Engine API, on 2 gloo ranks."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _parity import FairseqStyleOptimizer, adamw, assert_close_params, batch, ddp_reference, make_model, params_of

import shardwise
from shardwise.testing import distributed_test, run_subtests


def _train(engine: Any, steps: int, size: int = 4, micro: int = 1) -> list[float]:
    losses = []
    rank = dist.get_rank()
    for step in range(steps):
        for m in range(micro):
            idx, target = batch(step * micro + m, rank, size)
            loss = engine(idx, target)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


@distributed_test(world_size=2, timeout=120)
def test_stage0_matches_ddp_adamw() -> None:
    def case(clip: float) -> None:
        want = ddp_reference(5, adamw, clip=clip)
        model = make_model()
        engine = shardwise.initialize(model, adamw(model.parameters()), {"gradient_clipping": clip})
        _train(engine, 5)
        assert_close_params(params_of(model), want, atol=1e-6)
        engine.destroy()

    run_subtests(case, [{"clip": 0.0}, {"clip": 0.05}])


@distributed_test(world_size=2, timeout=120)
def test_accumulation_equals_big_batch() -> None:
    """4 micro-batches of 2 with accumulation == one step on the concatenated batch of 8."""
    model = make_model()
    engine = shardwise.initialize(model, adamw(model.parameters()), {"gradient_accumulation_steps": 4})
    rank = dist.get_rank()
    ref = make_model()
    ref_engine = shardwise.initialize(ref, adamw(ref.parameters()), {})
    for step in range(3):
        parts = [batch(10 * step + m, rank, size=2) for m in range(4)]
        applied = []
        for idx, target in parts:
            engine.backward(engine(idx, target))
            applied.append(engine.step())
        assert applied == [False, False, False, True]
        idx = torch.cat([p[0] for p in parts])
        target = torch.cat([p[1] for p in parts])
        ref_engine.backward(ref_engine(idx, target))
        assert ref_engine.step()
    assert engine.global_steps == 3 and engine.micro_steps == 12
    assert_close_params(params_of(model), params_of(ref), atol=1e-5)


@distributed_test(world_size=2, timeout=120)
def test_no_sync_accumulates_without_communication() -> None:
    model = make_model()
    engine = shardwise.initialize(model, adamw(model.parameters()), {})
    rank = dist.get_rank()
    before = dict(engine.comm.bytes_sent)
    with engine.no_sync():
        idx, target = batch(0, rank)
        engine.backward(engine(idx, target))
        with pytest.raises(RuntimeError, match="no_sync"):
            engine.step()
    assert dict(engine.comm.bytes_sent) == before, "no_sync must not communicate"
    idx, target = batch(1, rank)
    engine.backward(engine(idx, target))
    assert engine.step()
    # Reference: one step on the sum of both micro-batches' gradients.
    ref = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(ref)
    opt = adamw(ref.parameters())
    for step in (0, 1):
        idx, target = batch(step, rank)
        ddp(idx, target).backward()
    opt.step()
    assert_close_params(params_of(model), params_of(ref), atol=1e-6)


@distributed_test(world_size=2, timeout=120)
def test_clipping_matches_clip_grad_norm_one_process() -> None:
    """Global-norm clipping equals torch.nn.utils.clip_grad_norm_ on the full batch in one process."""
    model = make_model()
    engine = shardwise.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5), {"gradient_clipping": 0.01})
    ref = make_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(3):
        idx, target = batch(step, dist.get_rank())
        engine.backward(engine(idx, target))
        engine.step()
        both = [batch(step, r) for r in range(2)]
        loss = sum(ref(i, t) for i, t in both) / 2
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
        opt.step()
        opt.zero_grad()
        assert math.isclose(engine.optimizer.last_grad_norm, norm.item(), rel_tol=1e-5)
    assert_close_params(params_of(model), params_of(ref), atol=1e-6)


def _fp16_engine(**fp16: Any) -> Any:
    model = make_model()
    config = {"fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 3, "hysteresis": 2, **fp16}}
    return shardwise.initialize(model, adamw(model.parameters()), config)


def _fp16_step(engine: Any, step: int, poison: bool) -> bool:
    idx, target = batch(step, dist.get_rank())
    loss = engine(idx, target)
    if poison:
        loss = loss * float("inf")
    engine.backward(loss)
    return engine.step()


@distributed_test(world_size=2, timeout=120)
def test_fp16_overflow_on_one_rank_skips_everywhere() -> None:
    engine = _fp16_engine()
    rank = dist.get_rank()
    assert engine.loss_scale == 2.0**8
    before = params_of(engine.module)
    # inf on rank 1 only: every rank skips, hysteresis absorbs the first overflow.
    assert not _fp16_step(engine, 0, poison=rank == 1)
    assert engine.skipped_steps == 1 and engine.loss_scale == 2.0**8
    assert_close_params(params_of(engine.module), before, atol=0.0)
    # second overflow: hysteresis exhausted, the scale halves
    assert not _fp16_step(engine, 1, poison=rank == 0)
    assert engine.skipped_steps == 2 and engine.loss_scale == 2.0**7
    # DeepSpeed's rule: the clean step after three clean ones (the window) doubles it, not the third
    for step in range(2, 5):
        assert _fp16_step(engine, step, poison=False)
    assert engine.loss_scale == 2.0**7
    assert _fp16_step(engine, 5, poison=False)
    assert engine.loss_scale == 2.0**8 and engine.global_steps == 6
    engine.override_loss_scale(4.0)
    assert not _fp16_step(engine, 6, poison=True)
    assert engine.loss_scale == 4.0, "an override is not changed by overflow"
    engine.override_loss_scale(None)
    assert engine.loss_scale == 2.0**8


@distributed_test(world_size=2, timeout=120)
def test_fp16_trains_close_to_fp32() -> None:
    engine = _fp16_engine()
    _train(engine, 5)
    want = ddp_reference(5, adamw)
    assert engine.skipped_steps == 0
    assert_close_params(params_of(engine.module), want, atol=2e-3)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


@distributed_test(world_size=2, timeout=120)
def test_bf16_close_to_fp32_and_skips_nan() -> None:
    # SGD, not Adam: Adam normalises each update to ~lr, so a near-zero gradient
    # whose sign bf16 rounding flips moves by 2*lr and hides the real agreement.
    model = make_model()
    engine = shardwise.initialize(model, _sgd(model.parameters()), {"bf16": {"enabled": True}})
    assert next(model.parameters()).dtype == torch.bfloat16
    _train(engine, 5)
    want = ddp_reference(5, _sgd)
    # bf16 keeps ~3 significant digits (the model's weights are rounded to it);
    # the fp32 master weights stay within 5e-3 of the fp32 run.
    assert_close_params(params_of(model), want, atol=3e-2)
    master = engine.full_state_dict()
    if dist.get_rank() == 0:
        assert master["fc1.weight"].dtype == torch.float32
        assert_close_params({k: master[k] for k in want}, want, atol=5e-3)
    assert not _fp16_step(engine, 9, poison=dist.get_rank() == 1)
    assert engine.skipped_steps == 1


@distributed_test(world_size=2, timeout=120)
def test_lr_groups_and_scheduler_from_config() -> None:
    model = make_model()
    groups = [
        {"params": list(model.embed.parameters()), "lr": 0.1},
        {"params": [p for n, p in model.named_parameters() if not n.startswith("embed")], "lr": 0.01},
    ]
    engine = shardwise.initialize(model, torch.optim.SGD(groups, lr=1.0), {})
    assert engine.get_lr() == [0.1, 0.01]
    engine.set_lr(0.5)
    assert engine.get_lr() == [0.5, 0.5]
    engine.set_lr([0.2, 0.3])
    assert [g["lr"] for g in engine.optimizer.inner.param_groups] == [0.2, 0.3]
    with pytest.raises(ValueError, match="param groups"):
        engine.set_lr([1.0])

    config = {
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1,
                                                     "warmup_num_steps": 4, "warmup_type": "linear"}},
    }
    engine = shardwise.initialize(make_model(), config=config)
    seen = []
    for step in range(6):
        idx, target = batch(step, dist.get_rank())
        engine.backward(engine(idx, target))
        engine.step()
        seen.append(engine.get_lr()[0])
    # DeepSpeed's linear warmup: min + (max - min) * step / warmup, then flat at max
    want = [0.1 * min(1.0, s / 4) for s in range(1, 7)]
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(seen, want)), (seen, want)

    # a torch scheduler, as a callable `optimizer -> scheduler` and as an object
    for form in ("callable", "object"):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.8)
        halve = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)  # noqa: E731
        engine = shardwise.initialize(model, opt, {}, lr_scheduler=halve if form == "callable" else halve(opt))
        for step in range(3):
            engine.backward(engine(*batch(step, dist.get_rank())))
            engine.step()
        assert math.isclose(engine.get_lr()[0], 0.1), (form, engine.get_lr())


@distributed_test(world_size=2, timeout=120)
def test_optimizer_forms_train_alike() -> None:
    want = ddp_reference(3, adamw)

    def case(form: str, stage: int) -> None:
        model = make_model()
        optimizer: Any = {
            "wrapper": lambda: FairseqStyleOptimizer(model.parameters()),
            "callable": lambda: adamw,
            "torch": lambda: adamw(model.parameters()),
            "config": lambda: None,
        }[form]()
        config: dict[str, Any] = {"zero_optimization": {"stage": stage}}
        if form == "config":
            config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}
        engine = shardwise.initialize(model, optimizer, config)
        assert isinstance(engine.optimizer, shardwise.ShardwiseOptimizer)
        assert isinstance(engine.optimizer, torch.optim.Optimizer)
        _train(engine, 3)
        assert_close_params(params_of(model), want, atol=1e-6)
        engine.destroy()

    run_subtests(case, [{"form": f, "stage": s} for f in ("wrapper", "callable", "torch", "config") for s in (0, 2)])


@distributed_test(world_size=2, timeout=120)
def test_pass_through_to_module() -> None:
    model = make_model()
    engine = shardwise.initialize(model, adamw(model.parameters()), {})
    idx, _ = batch(0, dist.get_rank())
    assert torch.equal(engine.generate(idx, steps=3), model.generate(idx, steps=3))
    assert engine.fc1 is model.fc1
    with pytest.raises(AttributeError, match="Engine.*ParityNet.*no_such_thing"):
        _ = engine.no_such_thing
    assert engine.train() is engine and model.training
    engine.eval()
    assert not model.training


@distributed_test(world_size=2, timeout=120)
def test_initial_broadcast_makes_ranks_identical() -> None:
    model = make_model(seed=dist.get_rank())  # deliberately different per rank
    shardwise.initialize(model, adamw(model.parameters()), {})
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    assert torch.equal(gathered[0], gathered[1])


def test_inference_only_engine_refuses_backward() -> None:
    engine = shardwise.initialize(make_model(), None, {})
    idx, target = batch(0, 0)
    loss = engine(idx, target)
    with pytest.raises(RuntimeError, match="inference-only"):
        engine.backward(loss)
