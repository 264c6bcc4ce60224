"""Stage 3 in bf16 with the state in memory keeps each shard once, in fp32 (the master weights' storage), and casts it
to bf16 as it is sent: the values every path leaves in the masters and in the gathered parameters are those a bf16
shard beside separate fp32 masters held (exact masters, bf16 compute values), on 2 gloo ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _parity import adamw
from torch import nn

import shardwise
from shardwise.testing import distributed_test

CONFIG = {"bf16": {"enabled": True},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


class Writer(nn.Module):
    """``first`` is written in place inside the forward (one element of its weight); ``third`` is frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.third = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.write = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.write:
            with torch.no_grad():
                self.first.weight[0, 0] = 0.375
        return self.third(torch.tanh(self.second(torch.tanh(self.first(x))))).sum()


def _masters(engine: Any, model: nn.Module) -> dict[str, torch.Tensor]:
    full = engine.strategy.full_master_weights()
    return {name: full[id(param)] for name, param in model.named_parameters()}


def _gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    with shardwise.zero.GatheredParameters(list(model.parameters())):
        return {name: param.detach().clone() for name, param in model.named_parameters()}


def _rounded(value: torch.Tensor) -> torch.Tensor:
    return value.to(torch.bfloat16).float()


@distributed_test(world_size=2, timeout=240)
def test_stage3_bf16_shards_are_the_fp32_masters() -> None:
    torch.manual_seed(0)
    model = Writer()
    model.third.requires_grad_(False)
    initial = {name: param.detach().clone() for name, param in model.named_parameters()}
    engine = shardwise.initialize(model, adamw([p for p in model.parameters() if p.requires_grad]), CONFIG)
    units = engine.strategy.units
    assert all(unit.shard.dtype == torch.float32 and unit.full.dtype == torch.bfloat16 for unit in units), units
    memory = engine.memory_breakdown()
    numel = sum(p.numel() for p in initial.values())
    assert memory["master_weights"] == 0 and memory["parameters"] >= 4 * numel / 2, memory  # one fp32 copy of 1/N

    # at initialize: trainable masters exact, the frozen one as bf16 holds it; the forward computes in bf16
    masters = _masters(engine, model)
    for name, value in initial.items():
        want = _rounded(value) if name.startswith("third") else value
        assert torch.equal(masters[name], want), name
    for name, value in _gathered(model).items():
        assert value.dtype == torch.bfloat16 and torch.equal(value.float(), _rounded(initial[name])), name

    # a step: the gathered values are the stepped masters cast to bf16
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    engine.backward(engine(x))
    engine.step()
    stepped = _masters(engine, model)
    assert not torch.equal(stepped["first.weight"], masters["first.weight"])
    for name, value in _gathered(model).items():
        assert torch.equal(value.float(), _rounded(stepped[name])), name

    # an in-place write in a forward: the piece written (rank 0's, the unit's first 72 of 144 elements) takes the
    # bf16 values, every other piece stays exact
    model.write = True
    engine(x)
    model.write = False
    written = _masters(engine, model)
    assert written["first.weight"][0, 0] == 0.375
    mine, theirs = written["first.weight"].view(-1)[:72], written["first.weight"].view(-1)[72:]
    assert torch.equal(mine, _rounded(mine)) and not torch.equal(mine, stepped["first.weight"].view(-1)[:72])
    assert torch.equal(theirs, stepped["first.weight"].view(-1)[72:]) and not torch.equal(theirs, _rounded(theirs))
    for name in ("first.bias", "second.weight", "second.bias", "third.weight"):
        assert torch.equal(written[name], stepped[name]), name

    # a partial load: the loaded parameter's masters exact, the others' untouched
    loaded = torch.randn(16, 16, generator=torch.Generator().manual_seed(7))
    shardwise.zero.load_state_dict(model, {"second.weight": loaded}, strict=False)
    after = _masters(engine, model)
    assert torch.equal(after["second.weight"], loaded)
    for name in ("first.weight", "first.bias", "second.bias", "third.weight"):
        assert torch.equal(after[name], written[name]), name
    assert torch.equal(_gathered(model)["second.weight"].float(), _rounded(loaded))

    # GatheredParameters(modifier_rank=0): the parameter written takes the bf16 values written, the one beside it in
    # the unit keeps its exact masters (rounded before: silently lost precision)
    with shardwise.zero.GatheredParameters([model.second.weight, model.second.bias], modifier_rank=0):
        with torch.no_grad():
            model.second.bias.add_(1.0)
    modified = _masters(engine, model)
    assert torch.equal(modified["second.weight"], loaded) and not torch.equal(loaded, _rounded(loaded))
    assert torch.equal(modified["second.bias"], _rounded(_rounded(after["second.bias"]) + 1.0))
    engine.destroy()
