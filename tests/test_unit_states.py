"""Stage 3's explicit life cycle: unit states, holds taken and given back, the model's training state."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _parity import adamw, batch, make_model

import shardwise
from shardwise.testing import distributed_test
from shardwise.zero import GatheredParameters
from shardwise.zero.stage3.hooks import TrainingState
from shardwise.zero.stage3.params import UnitError, UnitState, unit_of

# units: embed 1024, fc1 408, fc2 600, head 200 elements: only the head is persistent
_CONFIG = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 250}}


def _engine() -> Any:
    model = make_model()
    return shardwise.initialize(model, adamw(model.parameters()), _CONFIG)


@distributed_test(world_size=2, timeout=120)
def test_unit_states_and_holds() -> None:
    engine = _engine()
    weight = engine.module.fc2.weight
    unit = unit_of(weight)
    assert unit is not None and not unit.persistent
    assert (unit.state, unit.holders) == (UnitState.SHARDED, 0)
    with GatheredParameters([weight]):
        assert (unit.state, unit.holders) == (UnitState.GATHERED, 1)
    assert (unit.state, unit.holders) == (UnitState.SHARDED, 0)

    unit.gather(async_op=True)  # a prefetch: in flight until waited on (collective: every rank does it)
    assert unit.state in (UnitState.GATHERING, UnitState.GATHERED)
    unit.wait()
    assert unit.state is UnitState.GATHERED
    unit.free()
    assert unit.state is UnitState.SHARDED

    with pytest.raises(UnitError, match="expected at least 1 holder, found 0"):
        unit.release()
    unit.acquire()
    unit.gather()
    with pytest.raises(UnitError, match=r"1 holder\(s\) still need"):
        unit.free()
    unit.release()
    unit.free()

    persistent = unit_of(engine.module.head.bias)
    assert persistent is not None and persistent.state is UnitState.PERSISTENT
    persistent.free()  # a persistent unit stays gathered
    assert persistent.state is UnitState.PERSISTENT

    with GatheredParameters([weight]):
        with pytest.raises(UnitError, match="still held"):
            engine.destroy()
    engine.destroy()
    assert unit_of(weight) is None, "destroy gives every parameter back"


@distributed_test(world_size=2, timeout=120)
def test_training_state_follows_forward_and_backward() -> None:
    engine = _engine()
    gatherer = engine.strategy.gatherer
    seen: dict[str, TrainingState] = {}

    def record(when: str) -> Any:
        def hook(*_: Any) -> None:
            seen.setdefault(when, gatherer.state)

        return hook

    engine.module.fc1.register_forward_hook(record("forward"))
    engine.module.fc1.register_full_backward_hook(record("backward"))
    assert gatherer.state is TrainingState.IDLE
    loss = engine(*batch(0, dist.get_rank()))
    assert gatherer.state is TrainingState.PRE_BACKWARD
    engine.backward(loss)
    assert gatherer.state is TrainingState.IDLE
    assert seen == {"forward": TrainingState.FORWARD, "backward": TrainingState.BACKWARD}, seen
    with torch.no_grad():
        engine(*batch(1, dist.get_rank()))
    assert gatherer.state is TrainingState.IDLE, "a forward without grad has no backward to wait for"
    held = [u for u in engine.strategy.units if u.holders]
    assert not held, f"every hold was given back: {held}"
    engine.step()
    engine.destroy()
