"""Stages 1-2: the all-gather after ``step()`` runs behind the next forward, and nobody sees stale values.

Against DDP with the same AdamW on 2 ranks (fp32: 1e-6): values read right after
``step()`` (a torch function, ``state_dict()``), and training over several steps.
Small buckets make several gathers, to show a forward waits bucket by bucket.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
from _parity import adamw, assert_close_params, batch, make_model, params_of
from torch.nn.parallel import DistributedDataParallel

import shardwise
from shardwise.testing import distributed_test
from shardwise.zero.flat.strategy import GatheringParameter


def _reference(steps: int) -> list[dict[str, torch.Tensor]]:
    model = make_model()
    ddp = DistributedDataParallel(model)
    opt = adamw(model.parameters())
    states = []
    for step in range(steps):
        ddp(*batch(step, dist.get_rank())).backward()
        opt.step()
        opt.zero_grad()
        states.append(params_of(model))
    return states


def _in_flight(model: torch.nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if type(p) is GatheringParameter}


@distributed_test(world_size=2, timeout=120)
def test_gathers_run_behind_the_next_forward_and_reads_see_updated_values() -> None:
    want = _reference(3)
    for stage in (1, 2):
        model = make_model()
        config = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 500}}
        engine = shardwise.initialize(model, adamw(model.parameters()), config)
        buckets = len(engine.strategy.layout.buckets)
        assert buckets >= 3, buckets

        engine.backward(engine(*batch(0, dist.get_rank())))
        engine.step()
        assert _in_flight(model) == {n for n, _ in model.named_parameters()}, "every bucket is in flight"
        # Reading `.grad` or `.requires_grad` is not a use of the values: nothing waits.
        assert all(p.grad is None and p.requires_grad for p in model.parameters())
        assert _in_flight(model) == {n for n, _ in model.named_parameters()}
        # A torch function on one parameter waits for its bucket only.
        got = model.fc2.weight.detach().clone()
        assert torch.equal(got, want[0]["fc2.weight"])
        assert "fc2.weight" not in _in_flight(model) and "embed.weight" in _in_flight(model)
        # state_dict() right after a step: the updated values, like DDP
        assert_close_params({n: t.float() for n, t in model.state_dict().items()}, want[0], atol=0)

        engine.backward(engine(*batch(1, dist.get_rank())))
        engine.step()
        # A copy or a pickle of the model made now holds the arrived values, in plain Parameters.
        clone = copy.deepcopy(model)
        restored = pickle.loads(pickle.dumps(model))
        assert _in_flight(model) == set() and _in_flight(clone) == set() and _in_flight(restored) == set()
        assert all(type(p) is torch.nn.Parameter for p in [*clone.parameters(), *restored.parameters()])
        assert_close_params(params_of(clone), want[1], atol=0)
        assert_close_params(params_of(restored), want[1], atol=0)
        # A forward waits as it goes: after it, nothing is in flight.
        engine(*batch(2, dist.get_rank()))
        assert _in_flight(model) == set()
        engine.backward(engine(*batch(2, dist.get_rank())))
        engine.step()
        assert_close_params(params_of(model), want[2], atol=1e-6)
        engine.destroy()
        assert _in_flight(model) == set(), "destroy leaves plain parameters"


@distributed_test(world_size=2, timeout=120)
def test_reduction_by_transport_is_said_and_counted() -> None:
    cases = ((None, True, "reduce_scatter", "chosen for shared memory"), (None, False, "all_reduce", "chosen for gloo"),
             (True, True, "reduce_scatter", "as configured"), (False, True, "all_reduce", "as configured"),
             (True, False, "reduce_scatter", "as configured"))
    for setting, shared, kind, why in cases:
        model = make_model()
        zero: dict[str, object] = {"stage": 2}
        if setting is not None:
            zero["reduce_scatter"] = setting
        config = {"zero_optimization": zero, "comms": {"shared_memory": shared}}
        engine = shardwise.initialize(model, adamw(model.parameters()), config)
        assert engine.comm.shm.active == shared
        engine.comm.reset_counters()
        engine.backward(engine(*batch(0, dist.get_rank())))
        engine.step()
        sent = engine.comm.bytes_sent
        # the gradients' reduction dominates (a few bytes of all-reduce carry the norm and overflow flags)
        assert max(("all_reduce", "reduce_scatter"), key=lambda k: sent.get(k, 0)) == kind, (setting, sent)
        assert why in engine.strategy.describe_reduction(), (setting, shared)
        engine.destroy()


@distributed_test(world_size=2, timeout=120)
def test_gradient_norm_follows_writes_between_backward_and_step() -> None:
    """The norm is summed per bucket while the reduction is waited for; a write to the gradients after
    backward (a user's own scaling) must still be seen by clipping and by get_global_grad_norm()."""
    for stage in (0, 1, 2):
        model = make_model()
        config = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 500}}
        engine = shardwise.initialize(model, adamw(model.parameters()), config)
        engine.backward(engine(*batch(0, dist.get_rank())))
        first = float(engine.strategy.step_sums()[0])
        assert first == pytest.approx(float(engine.strategy.grads.reduced.sq()), rel=1e-5)
        for grad in engine.strategy.grads.reduced.slices:
            grad.mul_(0.5)  # as a user scaling gradients in place before step()
        total = torch.tensor(first)
        if stage > 0:  # each rank summed its own slices
            dist.all_reduce(total)
        engine.step()
        assert engine.get_global_grad_norm() == pytest.approx(0.5 * float(total) ** 0.5, rel=1e-5), stage
        engine.destroy()
