"""``zero.Init``, ``GatheredParameters`` and ``register_external_parameter`` on 2 gloo ranks."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _parity import adamw, assert_close_params, full_params_everywhere, params_of
from torch import nn
from torch.nn.modules import module as module_hooks

import shardwise
from shardwise.testing import distributed_test, run_subtests
from shardwise.zero.stage3.params import is_partitioned

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPT, gpt_config  # noqa: E402

STAGE3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _lm_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randint(0, 256, (2, 9), generator=gen)
    return x[:, :-1], x[:, 1:]


def _train(engine: Any, steps: int) -> None:
    for step in range(steps):
        _, loss = engine(*_lm_batch(step, dist.get_rank()))
        engine.backward(loss)
        engine.step()


def _same_on_all_ranks(tensor: torch.Tensor) -> bool:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor.contiguous())
    return all(torch.equal(g, gathered[0]) for g in gathered)


class Big(nn.Module):
    """Runs F.linear on its own weights and initializes them in place inside ``__init__``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)
        with torch.no_grad():
            self.fc.weight.mul_(0.5)
            self.probe = F.linear(torch.ones(1, 32), self.fc.weight, self.fc.bias).sum().item()


class Tower(nn.Module):
    """Builds its layers one by one and records whether the earlier ones are already partitioned."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        self.freed_before: list[bool] = []
        for _ in range(4):
            self.freed_before.append(all(p.untyped_storage().nbytes() == 0 for p in self.layers.parameters()))
            self.layers.append(Big())
        self.scale = nn.Parameter(torch.ones(32))
        # parent-level init on partitioned children: nn.init (per operation) and `.data` (deferred)
        nn.init.constant_(self.layers[0].fc.bias, 0.25)
        self.layers[1].fc.bias.data.fill_(-0.5)
        self.layers[2].fc.weight.data[0].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer.fc(x))
        return (x * self.scale).sum()


@distributed_test(world_size=2, timeout=240)
def test_init_partitions_while_building_and_trains_like_a_plain_build() -> None:
    rank = dist.get_rank()
    hooks_before = (dict(module_hooks._global_module_registration_hooks),
                    dict(module_hooks._global_parameter_registration_hooks))
    module_init, linear = nn.Module.__init__, F.linear

    def gpt_case(bf16: bool) -> None:
        config = {**STAGE3, "bf16": {"enabled": bf16}}
        torch.manual_seed(0)
        want_model = GPT(gpt_config("tiny"))
        torch.manual_seed(rank)  # ranks build different values: rank 0's win, as without Init
        with shardwise.zero.Init(config=config):
            model = GPT(gpt_config("tiny"))
        assert all(is_partitioned(p) for p in model.parameters())
        assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
        with pytest.raises(RuntimeError, match="GatheredParameters"):
            model.wte.weight.sum()
        engine = shardwise.initialize(model, adamw(model.parameters()), config)
        want_engine = shardwise.initialize(want_model, adamw(want_model.parameters()), config)
        # master weights start exact (from the fp32 build), not rounded to bf16
        assert_close_params(full_params_everywhere(engine), full_params_everywhere(want_engine), atol=0.0)
        _train(engine, 3)
        _train(want_engine, 3)
        assert_close_params(full_params_everywhere(engine), full_params_everywhere(want_engine), atol=1e-6)
        engine.destroy()
        want_engine.destroy()

    def tower_case() -> None:
        torch.manual_seed(0)
        plain = Tower()
        torch.manual_seed(0)
        with shardwise.zero.Init(config=STAGE3):
            tower = Tower()
        assert tower.freed_before == [True] * 4, tower.freed_before
        assert [layer.probe for layer in tower.layers] == [layer.probe for layer in plain.layers]
        engine = shardwise.initialize(tower, None, STAGE3)
        assert_close_params(full_params_everywhere(engine), params_of(plain), atol=0.0)
        x = torch.randn(3, 32, generator=torch.Generator().manual_seed(5))
        torch.testing.assert_close(engine(x), plain(x), rtol=0, atol=1e-6)
        engine.destroy()

    def load_case() -> None:
        torch.manual_seed(3)
        source = GPT(gpt_config("tiny"))
        with shardwise.zero.Init(config=STAGE3):
            model = GPT(gpt_config("tiny"))
        params = list(model.parameters())
        with shardwise.zero.GatheredParameters(params, modifier_rank=0):
            if rank == 0:
                model.load_state_dict(source.state_dict())
        engine = shardwise.initialize(model, adamw(model.parameters()), STAGE3)
        assert_close_params(full_params_everywhere(engine), params_of(source), atol=0.0)
        prompt = _lm_batch(4, 0)[0][:, :4]
        assert torch.equal(engine.generate(prompt, 6), source.generate(prompt, 6))
        engine.destroy()

    def restored_case() -> None:
        after = (dict(module_hooks._global_module_registration_hooks),
                 dict(module_hooks._global_parameter_registration_hooks))
        assert after == hooks_before
        assert nn.Module.__init__ is module_init and F.linear is linear
        plain = nn.Linear(4, 4)
        assert type(plain.weight) is nn.Parameter and not is_partitioned(plain.weight)

    def errors_case() -> None:
        with pytest.raises(ValueError, match="stage"):
            shardwise.zero.Init(config={"zero_optimization": {"stage": 2}})
        with pytest.raises(TypeError, match="no_such_option"):
            shardwise.zero.Init(config=STAGE3, no_such_option=1)

    cases = [("gpt_fp32", lambda: gpt_case(False)), ("gpt_bf16", lambda: gpt_case(True)),
             ("tower", tower_case), ("load", load_case), ("restored", restored_case), ("errors", errors_case)]
    run_subtests(lambda name: dict(cases)[name](), [{"name": n} for n, _ in cases])


class Parent(nn.Module):
    """Reads ``child.weight`` through F.linear without calling ``child``."""

    def __init__(self, register: bool) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.child = nn.Linear(16, 4)
        self.seen_gathered: list[bool] = []
        if register:
            shardwise.zero.register_external_parameter(self, self.child.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen_gathered.append(self.child.weight.untyped_storage().nbytes() > 0)
        return F.linear(torch.tanh(self.embed(x)), self.child.weight, self.child.bias).square().mean()


@distributed_test(world_size=2, timeout=240)
def test_gathered_parameters_and_external_parameters() -> None:
    rank = dist.get_rank()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))

    def read_modify_case() -> None:
        torch.manual_seed(0)
        model = GPT(gpt_config("tiny"))
        engine = shardwise.initialize(model, adamw(model.parameters()), STAGE3)
        _train(engine, 1)
        full = full_params_everywhere(engine)
        weight = model.blocks[0].mlp.fc.weight
        with shardwise.zero.GatheredParameters(weight):
            assert torch.equal(weight.detach(), full["blocks.0.mlp.fc.weight"])
            assert _same_on_all_ranks(weight.detach())
            if rank == 0:
                weight.data.zero_()  # read-only block: discarded on exit
        with shardwise.zero.GatheredParameters([weight, model.wte.weight], modifier_rank=1):
            if rank == 1:
                weight.data.fill_(0.125)
                model.wte.weight.data[0].fill_(2.0)
        with shardwise.zero.GatheredParameters(weight):
            assert bool((weight == 0.125).all()) and _same_on_all_ranks(weight.detach())
        # the engine's fp32 master weights follow the modification, so training continues from it
        after = full_params_everywhere(engine)
        assert bool((after["blocks.0.mlp.fc.weight"] == 0.125).all())
        assert bool((after["wte.weight"][0] == 2.0).all())
        torch.testing.assert_close(after["wte.weight"][1:], full["wte.weight"][1:], rtol=0, atol=0)
        ref = GPT(gpt_config("tiny"))
        ref.load_state_dict(after, strict=False)
        prompt = _lm_batch(3, 0)[0][:, :4]
        assert torch.equal(engine.generate(prompt, 5), ref.generate(prompt, 5))
        engine.destroy()

    def external_case(register: bool) -> None:
        torch.manual_seed(0)
        ref = Parent(register=False)
        torch.manual_seed(0)
        model = Parent(register=register)
        engine = shardwise.initialize(model, adamw(model.parameters()), STAGE3)
        opt = adamw(ref.parameters())
        for _ in range(3):
            engine.backward(engine(x + rank))
            engine.step()
            ((ref(x) + ref(x + 1)) / 2).backward()
            opt.step()
            opt.zero_grad()
        assert model.seen_gathered == [register] * 3, model.seen_gathered
        assert_close_params(full_params_everywhere(engine), params_of(ref), atol=1e-5)
        engine.destroy()

    def other_stages_case() -> None:
        # GatheredParameters is a no-op where nothing is partitioned, so code runs at every stage
        model = nn.Linear(3, 3)
        engine = shardwise.initialize(model, adamw(model.parameters()), {"zero_optimization": {"stage": 2}})
        with shardwise.zero.GatheredParameters(model.parameters(), modifier_rank=0):
            assert model.weight.sum() is not None
        engine.destroy()

    def cast_then_modify_case() -> None:
        # built under zero.Init, cast to bf16, then modified on rank 0 before initialize: the masters start from the
        # value written (they started from the fp32 values kept at the cast before: the write was lost) and, for
        # everything not written, from the exact fp32 values (the write rounded nothing else)
        torch.manual_seed(0)
        ref = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
        torch.manual_seed(0)
        with shardwise.zero.Init():
            model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
        model.to(torch.bfloat16)
        with shardwise.zero.GatheredParameters([model[0].weight, model[0].bias], modifier_rank=0):
            if rank == 0:
                with torch.no_grad():
                    model[0].weight[:2].fill_(0.25)
        engine = shardwise.initialize(model, adamw(model.parameters()), {**STAGE3, "bf16": {"enabled": True}})
        masters = engine.strategy.full_master_weights()
        want = {name: p.detach().clone() for name, p in ref.named_parameters()}
        want["0.weight"][:2] = 0.25
        rows = slice(2, None)  # the rows of `0.weight` not written keep their exact values too
        for name, param in model.named_parameters():
            got = masters[id(param)]
            if name == "0.weight":
                assert torch.equal(got[:2], want[name][:2]), "the write missed the masters"
                assert torch.equal(got[rows], want[name][rows]), "the rows not written were rounded"
            else:
                assert torch.equal(got, want[name]), name
        engine.destroy()

    cases: list[tuple[str, Any]] = [("read_modify", read_modify_case), ("external", lambda: external_case(False)),
                                    ("registered", lambda: external_case(True)), ("others", other_stages_case),
                                    ("cast_then_modify", cast_then_modify_case)]
    run_subtests(lambda name: dict(cases)[name](), [{"name": n} for n, _ in cases])


@distributed_test(world_size=2, timeout=120)
def test_cudnn_rnn_weight_compaction_passes_partitioned_weights_by() -> None:
    """``Module.to`` on CUDA runs ``nn.RNNBase.flatten_parameters``, whose ``torch._cudnn_rnn_flatten_weight`` would
    re-point partitioned weights into one full buffer: it is skipped while they are partitioned (found on a GPU, where
    a DeepSpeed client's GRU built under ``zero.Init`` failed in ``initialize``).  The CPU never calls it, so the test
    calls it as flatten_parameters does; the GRU then trains as one built whole."""
    torch.manual_seed(0)
    whole = nn.GRU(8, 16, batch_first=True)
    with shardwise.zero.Init(config=STAGE3):
        torch.manual_seed(0)
        gru = nn.GRU(8, 16, batch_first=True)
    assert all(is_partitioned(p) for p in gru.parameters())
    got = torch._cudnn_rnn_flatten_weight(gru._flat_weights, 4, 8, 3, 16, 0, 1, True, False)
    assert got is None and all(is_partitioned(p) for p in gru.parameters())
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    engine = shardwise.initialize(gru, adamw(gru.parameters()), STAGE3)
    out, _ = engine(x)
    torch.testing.assert_close(out, whole(x)[0], rtol=0, atol=0)
