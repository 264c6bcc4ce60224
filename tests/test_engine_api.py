"""The Engine methods DeepSpeed client code calls, on 2 gloo ranks."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _parity import adamw, batch, make_model

import shardwise
from shardwise.checkpoint import load_consolidated
from shardwise.testing import distributed_test, run_subtests


@distributed_test(world_size=2, timeout=120)
def test_deepspeed_getters() -> None:
    config = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2}, "gradient_clipping": 0.5}
    model = make_model()
    engine = shardwise.initialize(model, adamw(model.parameters()), config, name="student")
    assert engine.name == "student"
    assert (engine.global_rank, engine.world_size) == (dist.get_rank(), 2)
    assert engine.local_rank == dist.get_rank()  # the harness sets LOCAL_RANK as torchrun does
    assert (engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()) == (3, 2)
    assert engine.train_batch_size() == 12
    assert engine.bfloat16_enabled() and not engine.fp16_enabled()
    assert engine.get_global_grad_norm() is None, "no step yet: no norm"
    assert (engine.zero_optimization_stage(), engine.gradient_clipping()) == (2, 0.5)
    assert not engine.was_step_applied(), "no step yet"
    for micro in range(2):
        engine.backward(engine(*batch(micro, dist.get_rank())))
        engine.step()
    norm = engine.get_global_grad_norm()
    assert norm is not None and math.isfinite(norm) and norm > 0, norm
    assert engine.was_step_applied()
    engine.destroy()

    bare = shardwise.initialize(make_model(), None, {})  # inference-only, no batch sizes
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu"):
        bare.train_batch_size()
    assert bare.gradient_accumulation_steps() == 1 and bare.get_global_grad_norm() is None
    assert bare.zero_optimization_stage() == 0 and bare.gradient_clipping() == 0.0


@distributed_test(world_size=2, timeout=120)
def test_was_step_applied_is_false_after_an_fp16_overflow() -> None:
    model = make_model()
    config = {"fp16": {"enabled": True, "initial_scale_power": 4}, "zero_optimization": {"stage": 1}}
    engine = shardwise.initialize(model, adamw(model.parameters()), config)
    engine.backward(engine(*batch(0, dist.get_rank())) * float("inf"))  # every rank overflows
    assert engine.step() is False and not engine.was_step_applied()
    engine.backward(engine(*batch(1, dist.get_rank())))
    assert engine.step() is True and engine.was_step_applied()
    engine.destroy()


@distributed_test(world_size=2, timeout=120)
def test_load_checkpoint_returns_path_and_client_state(tmp_path: Path) -> None:
    root = tmp_path / "run"  # fixtures are made once and passed to every rank: the same path
    model = make_model()
    engine = shardwise.initialize(model, adamw(model.parameters()), {"zero_optimization": {"stage": 1}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert engine.load_checkpoint(root) == (None, None), "a missing directory has nothing to load"
    assert any("holds no complete checkpoint" in str(w.message) for w in caught), [str(w.message) for w in caught]
    engine.backward(engine(*batch(0, dist.get_rank())))
    engine.step()
    saved = engine.save_checkpoint(root, client_state={"epoch": 4})
    path, client = engine.load_checkpoint(root)
    assert (path, client) == (saved, {"epoch": 4}), (path, client)
    engine.destroy()


@distributed_test(world_size=2, timeout=120)
def test_save_16bit_model(tmp_path: Path) -> None:
    def case(stage: int, suffix: str) -> None:
        model = make_model()
        config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": stage}}
        engine = shardwise.initialize(model, adamw(model.parameters()), config)
        engine.backward(engine(*batch(0, dist.get_rank())))
        engine.step()
        full = engine.full_state_dict()
        out = tmp_path / f"stage{stage}"
        assert engine.save_16bit_model(str(out), f"model{suffix}") is True
        dist.barrier()
        saved = load_consolidated(out / f"model{suffix}") if suffix == ".safetensors" else torch.load(
            out / f"model{suffix}", weights_only=True)
        assert saved.keys() == {n for n, _ in model.state_dict().items()}
        for name, value in saved.items():
            assert value.dtype == torch.bfloat16, (name, value.dtype)
            if dist.get_rank() == 0:
                torch.testing.assert_close(value, full[name].to(torch.bfloat16), rtol=0, atol=0)
        engine.destroy()

    run_subtests(case, [{"stage": s, "suffix": x} for s in (0, 3) for x in (".bin", ".safetensors")])


@distributed_test(world_size=2, timeout=120)
def test_checkpoint_carries_16bit_weights_when_asked(tmp_path: Path) -> None:
    model = make_model()
    zero = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}
    engine = shardwise.initialize(model, adamw(model.parameters()), {"bf16": {"enabled": True}, "zero_optimization": zero})
    engine.backward(engine(*batch(0, dist.get_rank())))
    engine.step()
    want = engine.state_dict_16bit()
    path = Path(engine.save_checkpoint(tmp_path / "run"))
    saved = torch.load(path / "pytorch_model.bin", weights_only=True)
    assert saved.keys() == {n for n, _ in model.state_dict().items()}
    if dist.get_rank() == 0:
        for name, value in saved.items():
            torch.testing.assert_close(value, want[name], rtol=0, atol=0)
    assert engine.load_checkpoint(tmp_path / "run")[0] == str(path), "the extra file does not disturb a load"
    engine.destroy()
