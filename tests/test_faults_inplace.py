"""In-place writes to ZeRO-3 parameters during a forward persist (they used to vanish when the unit was freed).

The model writes its own weights inside `forward`, three ways: a torch in-place
method on the parameter (`clamp_`), a write through `.data` (`mul_`), and a write
to a small parameter that stage 3 keeps gathered (a persistent unit). Trained at
stage 3 it must end where torch DDP ends (where such writes always persist); in
bf16 a written value must reach the fp32 master exactly, and the masters of the
parameters nobody wrote must keep their fp32 values. Ranks that write different
values fail the next step check instead of keeping a mosaic of both.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _faults_common import fault_config, outcome, record_row
from _parity import assert_close_params, params_of
from torch import nn

import shardwise
from shardwise.testing import distributed_test, run_subtests


class SelfEditing(nn.Module):
    """A net whose forward edits its own weights (weight clipping, decay through `.data`, a step counter)."""

    def __init__(self, rank_dependent: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.counter = nn.Parameter(torch.zeros(2), requires_grad=False)  # small: a persistent unit
        self.rank_dependent = rank_dependent

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.fc1.weight.clamp_(-0.2, 0.2)
            step = float(dist.get_rank() + 1) if self.rank_dependent else 1.0
            self.counter.add_(step)
        h = torch.tanh(self.fc1(x))
        self.fc2.weight.data.mul_(0.9)
        h = torch.tanh(self.fc2(h))
        return self.head(h)


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _ddp_reference(steps: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = SelfEditing()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = _sgd(model.parameters())
    for step in range(steps):
        x, y = _data(step)
        F.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return params_of(model)


def _engine(stage: int, threshold: int, bf16: bool = False, rank_dependent: bool = False) -> Any:
    torch.manual_seed(0)
    model = SelfEditing(rank_dependent)
    config = fault_config(stage, zero_optimization={"stage3_param_persistence_threshold": threshold},
                          bf16={"enabled": bf16})
    return shardwise.initialize(model, _sgd(model.parameters()), config)


def _train(engine: Any, steps: int) -> None:
    for step in range(steps):
        x, y = _data(step)
        engine.backward(F.mse_loss(engine(x).float(), y))
        engine.step()


def _persists_like_ddp(stage: int) -> None:
    engine = _engine(stage, threshold=10)  # `counter` (2 elements) persistent, the rest partitioned
    _train(engine, 3)
    got = {n: t.float() for n, t in engine.full_state_dict().items()}
    want = _ddp_reference(3)  # collective: every rank
    if dist.get_rank() == 0:
        assert_close_params(got, want, atol=1e-6)
        assert torch.equal(got["counter"], torch.full((2,), 3.0)), got["counter"]
    engine.destroy()


def _bf16_write_reaches_the_master() -> None:
    engine = _engine(3, threshold=0, bf16=True)
    head_before = {id(p): p.key.clone() for p in engine.strategy.store.pieces if p.key is not None
                   and p.name == "head.weight"}
    def fill(module: nn.Module, args: Any) -> None:
        module.weight.data.fill_(0.25)

    engine.module.fc1.register_forward_pre_hook(fill)
    engine.optimizer.inner.param_groups[0]["lr"] = 0.0  # the step changes nothing: only the write shows
    _train(engine, 1)
    for piece in engine.strategy.store.pieces:
        if piece.name == "fc1.weight" and piece.key is not None:
            assert torch.equal(piece.key, torch.full_like(piece.key, 0.25)), "the write missed the master"
        if id(piece) in head_before:
            assert torch.equal(piece.key, head_before[id(piece)]), "an unwritten master was rounded"
    with shardwise.zero.GatheredParameters([engine.module.fc1.weight]):
        assert torch.equal(engine.module.fc1.weight.float(), torch.full((16, 8), 0.25))
    engine.destroy()


def _outside_forward_persistent_write() -> None:
    engine = _engine(3, threshold=10)
    with torch.no_grad():
        engine.module.counter.fill_(7.0)  # a persistent unit is always gathered: no error, and it must stay
    _train(engine, 1)  # the step re-gathers persistent units from their shards
    assert torch.equal(engine.module.counter.detach().float(), torch.full((2,), 8.0)), engine.module.counter
    engine.destroy()


def _masters(engine: Any) -> dict[str, torch.Tensor]:
    full = engine.strategy.full_master_weights()  # collective
    return {name: full[id(param)] for name, param in engine.module.named_parameters() if id(param) in full}


def _flat_bf16_write_reaches_the_master(stage: int) -> None:
    """Stages 0-2 in bf16: a write that moves the parameter's version counter (here a torch in-place method in a
    forward) reaches this rank's fp32 masters exactly; before, the next step's publish overwrote it."""
    engine = _engine(stage, threshold=0, bf16=True)
    before = _masters(engine)

    def fill(module: nn.Module, args: Any) -> None:
        with torch.no_grad():
            module.weight.fill_(0.25)

    handle = engine.module.fc1.register_forward_pre_hook(fill)
    engine.optimizer.inner.param_groups[0]["lr"] = 0.0  # the step changes nothing: only the write shows
    _train(engine, 1)
    handle.remove()
    after = _masters(engine)
    assert torch.equal(after["fc1.weight"], torch.full((16, 8), 0.25)), "the write missed the master"
    assert torch.equal(after["head.weight"], before["head.weight"]), "an unwritten master was rounded"
    assert torch.equal(engine.module.fc1.weight.float(), torch.full((16, 8), 0.25))
    engine.destroy()


def _load_state_dict_after_initialize(stage: int) -> None:
    """``model.load_state_dict`` on the engine's module between steps (bf16): the next step starts from the loaded
    values at every stage (stages 0-2 lost them to the masters before); nothing else is rounded."""
    engine = _engine(stage, threshold=10, bf16=True)
    _train(engine, 1)
    before = _masters(engine)
    gen = torch.Generator().manual_seed(5)
    loaded = {"head.weight": torch.randn(4, 16, generator=gen), "head.bias": torch.randn(4, generator=gen)}
    if stage == 3:
        shardwise.zero.load_state_dict(engine.module, loaded, strict=False)
    else:
        engine.module.load_state_dict(loaded, strict=False)
    engine.optimizer.inner.param_groups[0]["lr"] = 0.0
    _train(engine, 1)
    after = _masters(engine)
    want = {n: v if stage == 3 else v.to(torch.bfloat16).float() for n, v in loaded.items()}  # (stage 3 loads fp32)
    for name, value in want.items():
        assert torch.equal(after[name], value), f"{name}: the load missed the master"
    for name in ("fc1.bias", "fc2.bias"):  # (the forward clamps `fc1.weight` and scales `fc2.weight` itself)
        assert torch.equal(after[name], before[name]), f"{name}: an unloaded master changed"
    engine.destroy()


def _outside_forward_data_write() -> None:
    """Stage 3: a write through ``.data`` of a persistent parameter between steps reaches its shard and master."""
    engine = _engine(3, threshold=10)
    engine.module.counter.data.fill_(7.0)  # no torch in-place method on the parameter: only the `.data` read shows
    assert torch.equal(_masters(engine)["counter"], torch.full((2,), 7.0)), "the write missed the master"
    _train(engine, 1)
    assert torch.equal(engine.module.counter.detach().float(), torch.full((2,), 8.0)), engine.module.counter
    assert torch.equal(_masters(engine)["counter"], torch.full((2,), 8.0))
    engine.destroy()


@distributed_test(world_size=2, timeout=120)
def test_inplace_writes_in_a_stage3_forward_persist() -> None:
    cases = [{"case": "ddp", "stage": s} for s in (0, 3)] + [{"case": "bf16"}, {"case": "outside"},
                                                             {"case": "outside-data"}]
    cases += [{"case": "flat-bf16", "stage": s} for s in (0, 1, 2)] + [{"case": "load", "stage": s} for s in range(4)]
    run_subtests(_case, cases)
    if dist.get_rank() == 0:
        record_row("misuse", "in-place writes to parameters inside a ZeRO-3 forward (`w.clamp_`, `w.data.mul_`)",
                   "3", "persist: each rank keeps its slice in its shard and fp32 master (1e-6 of DDP)", None)
        record_row("misuse", "bf16: `model.load_state_dict(...)` between steps, or `w.fill_` under `no_grad` in a "
                   "forward", "0 / 1 / 2 / 3", "persist: the masters of what changed take the values written, "
                   "every other master keeps its exact fp32 value", None)
        record_row("misuse", "a write through `.data` to a parameter ZeRO-3 keeps gathered, between steps", "3",
                   "persists: its shard and fp32 master take it before the next step or master read", None)


def _case(case: str, stage: int = 3) -> None:
    {"ddp": lambda: _persists_like_ddp(stage), "bf16": _bf16_write_reaches_the_master,
     "outside": _outside_forward_persistent_write, "outside-data": _outside_forward_data_write,
     "flat-bf16": lambda: _flat_bf16_write_reaches_the_master(stage),
     "load": lambda: _load_state_dict_after_initialize(stage)}[case]()


def _rank_dependent() -> dict[str, Any]:
    engine = _engine(3, threshold=10, rank_dependent=True)
    return outcome(lambda: _train(engine, 1))


@distributed_test(world_size=2, timeout=120)
def test_rank_dependent_writes_fail_the_step_check() -> None:
    result = _rank_dependent()
    assert result["error"] == "CollectiveMismatchError", result
    assert "in-place write" in result["message"] and "`counter`" in result["message"], result["message"]
    if dist.get_rank() == 0:
        record_row("misuse", "ranks write different values in place in a ZeRO-3 forward", "3",
                   "every rank raises `CollectiveMismatchError` at `step()` naming the write", result["seconds"])
