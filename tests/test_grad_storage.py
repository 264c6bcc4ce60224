"""Gradient storage is an object chosen once per stage (``shardwise.zero.flat.grads``), one process.

Each stage's storage and where its masters live (the master store's home), per precision; what a storage does with a fresh
gradient (copied over what it held, never added) and with none (zeros, "not used"); stage 2's path
from backward to the step passes through the storage and no stage 2 override; shared-memory
set-up lives in ``shardwise.comm.shm``, not in ``Comm``.  Multi-rank behaviour is covered, unchanged, by
test_zero12.py, test_stage0.py, test_user_grads.py and test_shm.py.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import shardwise
from shardwise.comm.distributed import Comm
from shardwise.zero.base import Backward
from shardwise.zero.flat.grads import FlatGrads, StagedGrads, private_zeros
from shardwise.zero.flat.layout import FlatLayout
from shardwise.zero.flat.strategy import Stage2

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `benchmarks` is a top-level package next to src/

from benchmarks.grad_path import trace_path  # noqa: E402

#: the parameters themselves are stepped (plain DDP), the masters are this rank's fp32 slice of the flat
#: parameter buffer, or they are separate fp32 copies
WHOLE, IN_BUFFER, SEPARATE = "whole", "in buffer", "separate"
# (stage, dtype) -> (storage, masters), one process (one shard): in fp32 with a flat gradient buffer the
# parameters are stepped themselves (plain DDP); stage 2's staged gradients never sit in `param.grad` at the step
EXPECTED = {
    (0, "fp32"): (FlatGrads, WHOLE), (1, "fp32"): (FlatGrads, WHOLE),
    (2, "fp32"): (StagedGrads, IN_BUFFER), (0, "bf16"): (StagedGrads, SEPARATE),
    (1, "bf16"): (StagedGrads, SEPARATE), (2, "bf16"): (StagedGrads, SEPARATE),
}


def _masters(strategy: object) -> str:
    whole, in_model = strategy.side.whole, strategy.store.home.in_model  # type: ignore[attr-defined]
    return WHOLE if whole else IN_BUFFER if in_model else SEPARATE


def _engine(stage: int, precision: str) -> shardwise.Engine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    config = {"zero_optimization": {"stage": stage}, "bf16": {"enabled": precision == "bf16"}}
    return shardwise.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)


@pytest.mark.parametrize("stage,precision", sorted(EXPECTED))
def test_each_stage_gets_its_storage_and_masters_beside_it(stage: int, precision: str) -> None:
    engine = _engine(stage, precision)
    storage, masters = EXPECTED[(stage, precision)]
    assert type(engine.strategy.grads) is storage and _masters(engine.strategy) == masters
    # fp32 with a flat buffer: the averages land in the buffer itself, nothing held apart
    in_place = storage is FlatGrads and precision == "fp32"
    assert (engine.strategy.grads.reduced.nbytes() == 0) == in_place
    engine.destroy()


def _layout() -> tuple[FlatLayout, nn.Parameter]:
    param = nn.Parameter(torch.zeros(3))
    return FlatLayout([param], 1 << 10, 1, 0), param


def _never(source: torch.Tensor, output: torch.Tensor) -> tuple[object, None]:
    raise AssertionError("no reduction expected here")


def test_flat_storage_copies_a_fresh_gradient_over_its_view_never_adds() -> None:
    layout, param = _layout()
    grads = FlatGrads(layout, torch.float32, torch.device("cpu"), private_zeros, Backward(), _never)
    param.grad = torch.full((3,), 2.0)
    assert grads.take(0, param)
    assert param.grad.data_ptr() == grads.flat.data_ptr()  # param.grad is now the buffer's view
    param.grad = torch.full((3,), 5.0)  # cleared, then a fresh gradient: it is the truth
    grads.keep(0, param, boundary=False)
    assert torch.equal(grads.flat[:3], torch.full((3,), 5.0))  # 5, not 2 + 5
    param.grad = None
    assert not grads.take(0, param) and torch.equal(param.grad, torch.zeros(3))  # zeros, and "not used"


def test_staged_storage_takes_at_the_boundary_only_and_frees_the_gradient() -> None:
    layout, param = _layout()
    grads = StagedGrads(layout, torch.float32, torch.device("cpu"), private_zeros, Backward(), _never)
    param.grad = torch.full((3,), 2.0)
    grads.keep(0, param, boundary=False)  # between boundaries: left in param.grad
    assert param.grad is not None and grads.nbytes() == 12 + grads.reduced.nbytes()
    grads.keep(0, param, boundary=True)
    assert param.grad is None
    assert torch.equal(grads.comm_input(layout.buckets[0])[:3], torch.full((3,), 2.0))
    assert not grads.take(0, param)  # no gradient: zeros for the sum
    assert torch.equal(grads.comm_input(layout.buckets[0]), torch.zeros(3))


def test_stage_2_gradient_path_goes_through_the_storage_not_a_stage_2_override() -> None:
    count = trace_path(2).counts()
    files = {step.split(" > ")[-1] for step in count["path"]}
    assert "zero/flat/grads.py" in files, count["path"]
    assert not [name for name, value in vars(Stage2).items() if inspect.isfunction(value)]  # only its storage differs


def test_shared_memory_set_up_is_not_in_comm() -> None:
    set_up = {"shared_zeros", "_share", "_exchange", "_agree", "_raw", "_in_shm", "_offer_tensor",
              "shared_memory", "transport_name"}
    assert set_up.isdisjoint(vars(Comm)), sorted(set_up & set(vars(Comm)))
    comm = Comm(None)
    assert not comm.shm.active and comm.shm.zeros(4, torch.float32, torch.device("cpu")).shape == (4,)
