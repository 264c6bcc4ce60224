"""DeepSpeed-style warmup schedules against their formulas, computed independently here."""

from __future__ import annotations

import math

import pytest
import torch
from torch.optim.lr_scheduler import LRScheduler

from shardwise.config import Config, ConfigError
from shardwise.optim.schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler

STEPS = 14


def two_group_sgd(lrs: tuple[float, float] = (0.1, 0.02)) -> torch.optim.SGD:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    return torch.optim.SGD([{"params": [a], "lr": lrs[0]}, {"params": [b], "lr": lrs[1]}])


def warm(n: int, steps: int, kind: str) -> float:
    """Fraction of warmup done at iteration n (DeepSpeed's log and linear curves)."""
    if n >= steps:
        return 1.0
    return math.log(n + 1) / math.log(steps) if kind == "log" else n / steps


def lrs_over_steps(scheduler: LRScheduler, optimizer: torch.optim.Optimizer) -> list[float]:
    """The groups' lrs at iterations 0..STEPS-1, flattened: construction sets iteration 0, each step() the next."""
    seen: list[float] = []
    for _ in range(STEPS):
        current = [g["lr"] for g in optimizer.param_groups]
        assert scheduler.get_last_lr() == current
        seen.extend(current)
        scheduler.step()
    return seen


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr(kind: str) -> None:
    opt = two_group_sgd()
    lows, highs, steps = [0.0, 0.01], [0.1, 0.05], 5
    sched = WarmupLR(opt, warmup_min_lr=lows, warmup_max_lr=highs, warmup_num_steps=steps, warmup_type=kind)
    expected = [lo + (hi - lo) * warm(n, steps, kind) for n in range(STEPS) for lo, hi in zip(lows, highs)]
    assert lrs_over_steps(sched, opt) == pytest.approx(expected)
    assert isinstance(sched, LRScheduler)


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr(kind: str) -> None:
    opt = two_group_sgd()
    lows, highs, steps, total = [0.001, 0.0], [0.1, 0.2], 4, 10

    def gamma(n: int) -> float:
        return warm(n, steps, kind) if n < steps else max(0.0, (total - n) / (total - steps))

    sched = WarmupDecayLR(opt, total, warmup_min_lr=lows, warmup_max_lr=highs, warmup_num_steps=steps,
                          warmup_type=kind)
    expected = [lo + (hi - lo) * gamma(n) for n in range(STEPS) for lo, hi in zip(lows, highs)]
    assert lrs_over_steps(sched, opt) == pytest.approx(expected)
    assert expected[-2:] == lows  # past total_num_steps the lr rests at the minimum


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr_is_relative_to_each_initial_lr(kind: str) -> None:
    initial = (0.1, 0.02)
    opt = two_group_sgd(initial)
    steps, total, wmin, cmin = 3, 10, 0.1, 0.01

    def ratio(n: int) -> float:
        if n < steps:
            return wmin + (1 - wmin) * warm(n, steps, kind)
        done = min(n - steps + 1, total - steps)
        return cmin + (1 - cmin) * (1 + math.cos(math.pi * done / (total - steps))) / 2

    sched = WarmupCosineLR(opt, total, warmup_min_ratio=wmin, warmup_num_steps=steps, cos_min_ratio=cmin,
                           warmup_type=kind)
    expected = [lr * ratio(n) for n in range(STEPS) for lr in initial]
    assert lrs_over_steps(sched, opt) == pytest.approx(expected)
    assert expected[-2:] == pytest.approx([lr * cmin for lr in initial])


def test_zero_warmup_starts_at_max() -> None:
    opt = two_group_sgd()
    WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.3, warmup_num_steps=0)
    assert [g["lr"] for g in opt.param_groups] == [0.3, 0.3]


def test_works_with_any_param_groups_object() -> None:
    class Wrapper:
        def __init__(self) -> None:
            self.param_groups = [{"lr": 1.0}, {"lr": 2.0}]

    wrapper = Wrapper()
    sched = WarmupCosineLR(wrapper, total_num_steps=4, warmup_num_steps=0, cos_min_ratio=0.0)
    for _ in range(4):
        sched.step()
    assert [g["lr"] for g in wrapper.param_groups] == pytest.approx([0.0, 0.0])
    with pytest.raises(TypeError, match="param_groups"):
        WarmupLR(object())


@pytest.mark.parametrize("make", [
    lambda opt: WarmupLR(opt, warmup_min_lr=[0.0, 0.01], warmup_max_lr=0.1, warmup_num_steps=6),
    lambda opt: WarmupDecayLR(opt, 12, warmup_max_lr=[0.2, 0.1], warmup_num_steps=4, warmup_type="linear"),
    lambda opt: WarmupCosineLR(opt, 12, warmup_num_steps=3),
])
def test_state_dict_round_trip(make) -> None:  # type: ignore[no-untyped-def]
    first_opt = two_group_sgd()
    first = make(first_opt)
    for _ in range(7):
        first.step()
    state = first.state_dict()
    second_opt = two_group_sgd()
    second = make(second_opt)
    second.load_state_dict(state)
    assert second.last_batch_iteration == first.last_batch_iteration == 7
    assert [g["lr"] for g in second_opt.param_groups] == [g["lr"] for g in first_opt.param_groups]
    for _ in range(3):
        first.step()
        second.step()
        assert second.get_last_lr() == first.get_last_lr()
    # A DeepSpeed scheduler checkpoint holds only the iteration.
    third = make(two_group_sgd())
    third.load_state_dict({"last_batch_iteration": first.last_batch_iteration})
    assert third.get_last_lr() == first.get_last_lr()


def test_bad_arguments_raise_value_error() -> None:
    with pytest.raises(ValueError, match="total_num_steps"):
        WarmupDecayLR(two_group_sgd(), total_num_steps=5, warmup_num_steps=10)
    with pytest.raises(ValueError, match="warmup_type"):
        WarmupLR(two_group_sgd(), warmup_type="cubic")
    with pytest.raises(ValueError, match="2 param groups"):
        WarmupLR(two_group_sgd(), warmup_max_lr=[0.1, 0.2, 0.3])


def test_build_scheduler_from_config_dict() -> None:
    opt = two_group_sgd()
    sched = build_scheduler({"type": "warmupdecaylr", "params": {
        "total_num_steps": 20, "warmup_max_lr": 0.5, "warmup_num_steps": 5, "warmup_type": "linear"}}, opt)
    assert isinstance(sched, WarmupDecayLR)
    assert (sched.total_num_steps, sched.warmup_num_steps, sched.max_lrs) == (20, 5, [0.5, 0.5])

    cfg = Config.load({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 2000}}})
    assert cfg.scheduler is not None
    assert isinstance(build_scheduler(cfg.scheduler, two_group_sgd()), WarmupCosineLR)

    with pytest.raises(ConfigError, match="`scheduler.params.warmup_num_step`; did you mean `warmup_num_steps`"):
        build_scheduler({"type": "WarmupLR", "params": {"warmup_num_step": 3}}, opt)
