"""A gradient's path (``python -m benchmarks.grad_path``).

The counter's "one gradient" rule on made-up episodes; the measured path at stages 2 and 3 held to the
target of issue 36 (at most 7 files and 20 switches, every file counted) on the workload the benchmark
traces (four Linear modules, bf16, AdamW, clipping; stage 3 at persistence threshold 0, so that the module
hooks gather and free every unit; stages 0-2 with four buckets), in one process and on two gloo ranks; what
two ranks add to it; stage 3's backward leaves no unit held and no call waiting for gradients;
``take_grads`` writes zeros where it must without a memset of the whole unit.
"""

from __future__ import annotations

import collections
import functools
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise
from shardwise.testing import distributed_test
from shardwise.zero.stage3.params import UnitState
from shardwise.zero.stage3.strategy import take_grads

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `benchmarks` is a top-level package next to src/

from benchmarks.grad_path import TARGET, PathCount, build_model, trace_path, trace_ranks, workload  # noqa: E402

#: what a rank waits through when a peer is late past a slice: the peer's timing, not the path (see `_two_ranks`)
SLOW_PEER = {"faults/control.py", "faults/published.py"}


def _path(calls: list[tuple[str, str, int | None]]) -> PathCount:
    path = PathCount()
    for caller, callee, episode in calls:
        path.calls.append((caller, callee))
        path.episodes.append(episode)
    return path


def test_one_gradient_drops_the_hooks_that_repeat_the_start_of_the_launching_one() -> None:
    hook, launch, reduce = ("engine.py", "zero/grads.py"), ("zero/grads.py", "zero/stage1.py"), \
        ("zero/stage1.py", "distributed.py")
    raw = _path([("", "engine.py", None), (*hook, 0), (*hook, 1), (*hook, 2), (*launch, 2), (*reduce, 2),
                 (*hook, 3), (*hook, 4), ("engine.py", "zero/flat.py", None)])
    one = raw.one_gradient()
    # episodes 0, 1, 3 and 4 repeat the start of episode 2, the one whose arrival launched the bucket
    assert one.calls == [("", "engine.py"), hook, launch, reduce, ("engine.py", "zero/flat.py")]
    assert raw.counts()["switches"] - one.counts()["switches"] == 4


def test_identical_launching_episodes_count_once_and_different_ones_all_stay() -> None:
    hook, other = ("engine.py", "zero/grads.py"), ("zero/grads.py", "zero/stage1.py")
    side = ("engine.py", "zero/hooks.py")
    raw = _path([(*hook, 0), (*other, 0), (*hook, 1), (*other, 1), (*side, 2)])
    assert raw.one_gradient().calls == [hook, other, side]


def test_every_file_is_counted_and_the_bookkeeping_is_reported_beside_the_total() -> None:
    raw = _path([("", "engine/engine.py", None), ("engine/engine.py", "faults/ledger.py", None),
                 ("engine/engine.py", "comm/distributed.py", None), ("comm/distributed.py", "comm/shm.py", None)])
    counts = raw.counts()
    assert (counts["files"], counts["switches"]) == (4, 3)
    assert counts["beside"]["bookkeeping"] == {"files": ["faults/ledger.py"], "switches": 1}
    assert counts["beside"]["transport"] == {"files": ["comm/shm.py"], "switches": 1}


@pytest.mark.parametrize("stage", [2, 3])
def test_the_traced_workload_takes_the_hard_path(stage: int) -> None:
    """Stage 3 keeps no persistent unit (each module's unit is gathered and freed around its passes); the flat
    stages reduce several buckets; bf16, clipping and AdamW are on."""
    engine = shardwise.initialize(build_model(), config=workload(stage))
    strategy: Any = engine.strategy
    assert engine.precision.dtype == torch.bfloat16 and engine.optimizer is not None
    assert engine.optimizer.clip == 1.0 and isinstance(engine.optimizer.inner, torch.optim.AdamW)
    if stage == 3:
        assert len(strategy.units) == 4 and not any(unit.persistent for unit in strategy.units)
    else:
        assert len(strategy.layout.buckets) == 4
    engine.destroy()


def _check(counts: dict[str, Any], stage: int) -> None:
    files, switches = TARGET
    assert counts["files"] <= files and counts["switches"] <= switches, (counts["files"], counts["switches"],
                                                                         counts["path"])
    visited = set(counts["file_list"])
    if stage == 3:  # the module hooks gather and free the units on the path
        assert {"zero/stage3/hooks.py", "zero/stage3/params.py"} <= visited, sorted(visited)
    else:
        assert "zero/flat/grads.py" in visited, sorted(visited)


@pytest.mark.parametrize("stage", [2, 3])
def test_the_path_meets_the_target_in_one_process(stage: int) -> None:
    raw = trace_path(stage)
    _check(raw.one_gradient().counts(), stage)


def _two_ranks(stage: int) -> dict[str, Any]:
    """Rank 0's path on two ranks.  A peer late past a wait's first slice makes rank 0 say so and read what
    the peers published (the slow-peer files): the timing of this machine, not the path, so such a run is
    traced once more (a second one must not wait)."""
    counts = trace_ranks(stage, 2).one_gradient().counts()
    if SLOW_PEER & set(counts["file_list"]):
        counts = trace_ranks(stage, 2).one_gradient().counts()
    return counts


@pytest.mark.parametrize("stage", [2, 3])
def test_the_path_meets_the_target_on_two_ranks(stage: int) -> None:
    _check(_two_ranks(stage), stage)


def test_two_ranks_add_the_announcement_the_norm_and_the_flags_only() -> None:
    """With two ranks the engine's backward is announced (one exchange) and the flat stages shard, so the
    norm's all-reduce joins the path, as does their agreement on which parameters had gradients (one process
    knows that alone); everything else is the same calls as in one process."""
    for stage, extra in ((2, ["engine/engine.py > comm/distributed.py", "optim/precision.py > comm/distributed.py",
                              "zero/flat/strategy.py > comm/distributed.py"]),
                         (3, ["engine/engine.py > comm/distributed.py"])):
        alone = trace_path(stage).one_gradient().counts()["path"]
        ranks = _two_ranks(stage)["path"]
        added = collections.Counter(ranks) - collections.Counter(alone)
        assert sorted(added.elements()) == sorted(extra) and not collections.Counter(alone) - collections.Counter(
            ranks), (stage, alone, ranks)


def _stage3_engine() -> shardwise.Engine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    # no persistent unit: every module's unit is gathered and freed by the hooks
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    return shardwise.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)


def test_stage3_backward_releases_every_unit_and_forgets_the_calls_waiting_for_gradients() -> None:
    engine = _stage3_engine()
    gatherer = engine.strategy.gatherer
    released: list[tuple[int, int]] = []  # (unit, its holders once its gradients were in), during backward
    ready = gatherer.grads_ready

    def noting(unit: object) -> None:
        ready(unit)
        released.append((engine.strategy.units.index(unit), unit.holders))

    gatherer.grads_ready = noting
    for _ in range(2):
        released.clear()
        engine.backward(engine(torch.randn(2, 8)).pow(2).sum())  # the first layer's input needs no gradient
        # the first layer's call has no post-backward: its unit is let go as soon as its gradients are in,
        # and only that unit is looked up there (the others are released by their post-backward)
        assert released == [(0, 0)]
        assert gatherer.held_for_grads == {}
        assert all(u.holders == 0 and u.state is UnitState.SHARDED for u in engine.strategy.units)
        engine.step()
    engine.destroy()


def test_take_grads_writes_zeros_for_no_gradient_frozen_and_padding() -> None:
    engine = _stage3_engine()
    unit = engine.strategy.units[0]  # the first Linear: weight (index 0) and bias (index 1)
    engine(torch.randn(2, 8)).sum().backward()  # a plain backward: gradients stay in `param.grad`
    with torch._C.DisableTorchFunctionSubclass():
        weight_grad = unit.params[0].grad.clone()
        unit.params[1].grad = None  # this rank had no gradient for the bias
    flat, had = take_grads(unit, [0, 1], torch.float32)
    assert had == {0}
    assert torch.equal(unit.param_view(flat, 0), weight_grad)
    assert torch.count_nonzero(flat[unit.offsets[1]:]) == 0  # the bias's zeros and the padding
    with torch._C.DisableTorchFunctionSubclass():
        unit.params[0].grad = torch.ones_like(weight_grad)
    flat, had = take_grads(unit, [1], torch.float32)  # the weight not asked for (frozen): zeros, grad untouched
    with torch._C.DisableTorchFunctionSubclass():
        assert had == set() and torch.count_nonzero(flat) == 0 and unit.params[0].grad is not None
        unit.params[0].grad = None
    engine.destroy()


def _noting(calls: list[str], zero_grad: Callable[[], None]) -> None:
    calls.append("zero_grad")
    zero_grad()


@distributed_test(world_size=2, timeout=120)
def test_the_engines_step_drops_gradients_in_its_own_call_and_a_direct_optimizer_step_keeps_them() -> None:
    """`engine.step()` drops the gradients inside the strategy's step (no `zero_grad` call after it); a
    script's own `optimizer.step()` keeps them until its `zero_grad`, as torch's optimizers do."""
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        config = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
        engine = shardwise.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
        calls: list[str] = []
        engine.strategy.zero_grad = functools.partial(_noting, calls, engine.strategy.zero_grad)  # type: ignore[method-assign]
        engine.backward(engine(torch.randn(2, 8)).pow(2).sum())
        assert engine.optimizer.step()
        assert engine.strategy.has_pending_grads() and not calls, stage
        if stage == 3:
            assert engine.strategy.store.grads(), "stage 3: a direct optimizer.step() dropped the gradients"
        engine.zero_grad()
        assert not engine.strategy.has_pending_grads() and calls == ["zero_grad"], stage
        calls.clear()
        engine.backward(engine(torch.randn(2, 8)).pow(2).sum())
        engine.step()
        assert not engine.strategy.has_pending_grads() and not calls, (stage, calls)
        if stage == 3:
            assert not engine.strategy.store.grads() and engine.strategy.store.share is None
        engine.destroy()


@distributed_test(world_size=2, timeout=120)
def test_stage3_sums_the_norm_and_the_had_a_gradient_flags_in_one_all_reduce_a_step() -> None:
    """Stage 3's flags ride the norm's all-reduce: a step's backward and update issue one all-reduce (the
    flat stages keep theirs at the end of backward, where DDP leaves a globally unused `.grad` None)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine = shardwise.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    engine.backward(engine(torch.randn(2, 8)).pow(2).sum())
    engine.step()
    engine.comm.reset_counters()
    engine.backward(engine(torch.randn(2, 8)).pow(2).sum())
    engine.step()
    assert engine.comm.calls["all_reduce"] == 1, dict(engine.comm.calls)
    # the norm and one flag per trainable parameter (4), fp32
    assert engine.comm.bytes_sent["all_reduce"] == 2 * 0.5 * 4 * (1 + 4), dict(engine.comm.bytes_sent)
    engine.destroy()


@distributed_test(world_size=2, timeout=120)
def test_stage3_norm_follows_a_scripts_writes_to_the_gradients_between_backward_and_step() -> None:
    """Stage 3 takes the norm's share as the reduction finishes; a script that scales the gradients in place,
    or replaces them, before `step()` must still be clipped (and checked for overflow) by what it wrote."""
    for how in ("in place", "replaced", "nan"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
        engine = shardwise.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
        engine.backward(engine(torch.randn(2, 8, generator=torch.Generator().manual_seed(dist.get_rank()))).sum())
        before = engine.strategy.step_sums()[0].clone()
        masters = [p for group in engine.optimizer.param_groups for p in group["params"] if p.grad is not None]
        for master in masters:
            if how == "in place":
                master.grad.mul_(100.0)
            elif how == "replaced":
                master.grad = master.grad * 100.0
        if how == "nan":
            masters[0].grad.view(-1)[0] = float("nan")
        want = torch.stack([m.grad.pow(2).sum() for m in masters]).sum()
        dist.all_reduce(want)
        applied = engine.step()
        if how == "nan":
            assert not applied and engine.skipped_steps == 1, "a NaN written after backward was not seen"
        else:
            assert applied and float(before) > 0
            assert engine.get_global_grad_norm() == pytest.approx(float(want) ** 0.5, rel=1e-5), how
        engine.destroy()


@distributed_test(world_size=2, timeout=120)
def test_a_torch_lr_scheduler_sees_the_engines_step_as_an_optimizer_step() -> None:
    """torch's schedulers wrap `optimizer.step` to learn it ran; `engine.step()` goes through it (no
    "lr_scheduler.step() before optimizer.step()" warning)."""
    for stage in (1, 3):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        engine = shardwise.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero_optimization": {"stage": stage}},
            lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            engine.backward(engine(torch.randn(2, 8)).sum())
            engine.step()
        assert engine.get_lr() == [0.05], stage
        engine.destroy()
