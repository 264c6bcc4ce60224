"""Stage 3's life cycles refuse illegal moves: one process, a unit over a world of one, no engine.

A unit's state and a model's training state change only through one checked
move; a call the life cycle does not allow (``gather()`` of a gathered unit,
``wait()`` with no gather in flight, freeing a sharded unit) raises a
:class:`UnitError` naming the unit, the state it was in and the move attempted.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Optional

import pytest
import torch
from torch import nn

from shardwise.comm.distributed import Comm
from shardwise.zero.stage3.hooks import Gatherer, TrainingState
from shardwise.zero.stage3.params import _UNIT_MOVES, Unit, UnitError, UnitState, move, restore_parameter

T = TrainingState
S = UnitState

#: the life cycles as documented (params.Unit, hooks.TrainingState): written out here, so a change to a table fails
_UNIT_LEGAL = {(S.SHARDED, S.GATHERING), (S.GATHERING, S.GATHERED), (S.GATHERED, S.SHARDED),
               (S.GATHERED, S.PERSISTENT), (S.PERSISTENT, S.GATHERED)}
_TRAINING_LEGAL = {(T.IDLE, T.FORWARD), (T.PRE_BACKWARD, T.FORWARD), (T.FORWARD, T.PRE_BACKWARD),
                   (T.FORWARD, T.IDLE), (T.IDLE, T.BACKWARD), (T.PRE_BACKWARD, T.BACKWARD),
                   (T.BACKWARD, T.BACKWARD), (T.BACKWARD, T.IDLE)}


class _Owner:
    """A unit owner that gathers nothing on its own (the tests drive the unit directly)."""

    def needs(self, unit: Unit) -> bool:
        return False

    def on_demand(self, units: list[Unit], func: Any, mutating: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def on_data_access(self, unit: Unit) -> None:
        pass

    def on_cast(self, unit: Unit, device: Optional[torch.device], dtype: Optional[torch.dtype]) -> bool:
        return False

    def release(self, unit: Unit) -> None:
        unit.release()

    def on_params_modified(self, unit: Unit) -> None:
        pass

    def on_values_loaded(self, unit: Unit, values: torch.Tensor, loaded: set[int]) -> None:
        pass

    def on_traced_read(self, unit: Unit, param: torch.Tensor) -> None:
        pass

    def on_gathered_data_access(self, unit: Unit) -> None:
        pass

    def on_write(self, unit: Unit) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def _unit(persistent: bool = False) -> Unit:
    param = nn.Parameter(torch.arange(6, dtype=torch.float32).reshape(2, 3))
    unit = Unit(0, [param], ["block.weight"], Comm(), _Owner(), persistent)
    unit.build(unit.flatten([param.detach()], torch.float32, param.device), torch.float32)
    return unit


@pytest.fixture
def unit() -> Any:
    made = _unit()
    yield made
    restore_parameter(made.params[0])


def test_gather_of_a_gathered_unit_raises_naming_unit_state_and_move(unit: Unit) -> None:
    unit.gather()
    assert unit.state is S.GATHERED
    with pytest.raises(UnitError, match=r"Unit\(0, \['block.weight'\].*cannot start a gather "
                                        r"\(gathered -> gathering\): expected it sharded, found gathered"):
        unit.gather()
    assert unit.state is S.GATHERED, "a refused move leaves the state as it was"


def test_wait_with_no_gather_in_flight_raises(unit: Unit) -> None:
    with pytest.raises(UnitError, match=r"cannot finish a gather \(sharded -> gathered\): expected it gathering"):
        unit.wait()
    unit.gather(async_op=True)
    unit.wait()
    with pytest.raises(UnitError, match=r"\(gathered -> gathered\).*found gathered"):
        unit.wait()


def test_free_and_refresh_of_a_sharded_unit_raise(unit: Unit) -> None:
    assert unit.state is S.SHARDED
    with pytest.raises(UnitError, match=r"cannot free its full values \(sharded -> sharded\)"):
        unit.free()
    with pytest.raises(UnitError, match=r"cannot refresh its full values .*expected it gathered, found sharded"):
        unit.refresh()


def test_gather_of_a_persistent_unit_raises_and_free_keeps_it() -> None:
    unit = _unit(persistent=True)
    assert unit.state is S.PERSISTENT
    with pytest.raises(UnitError, match=r"\(persistent -> gathering\): expected it sharded, found persistent"):
        unit.gather()
    unit.free()  # documented: a persistent unit stays gathered
    assert unit.state is S.PERSISTENT
    unit.unpersist()
    unit.free()
    assert unit.state is S.SHARDED
    restore_parameter(unit.params[0])


def test_ensure_gathered_from_every_state_gives_the_values(unit: Unit) -> None:
    want = torch.arange(6, dtype=torch.float32)
    unit.ensure_gathered()  # from sharded
    assert unit.state is S.GATHERED and torch.equal(unit.full[:6], want)
    unit.ensure_gathered()  # from gathered: nothing to do
    unit.free()
    unit.gather(async_op=True)
    unit.ensure_gathered()  # from gathering: finishes it
    assert unit.state is S.GATHERED and torch.equal(unit.full[:6], want)


@pytest.mark.parametrize("current,to", list(itertools.product(S, S)))
def test_unit_moves_follow_the_documented_life_cycle(current: UnitState, to: UnitState) -> None:
    if (current, to) in _UNIT_LEGAL:
        assert move(0, "unit", current, to, _UNIT_MOVES, "move", "fix") is to
    else:
        with pytest.raises(UnitError, match=rf"rank 0: unit cannot move \({current.value} -> {to.value}\)"):
            move(0, "unit", current, to, _UNIT_MOVES, "move", "fix")


@pytest.mark.parametrize("current,to", list(itertools.product(T, T)))
def test_training_state_moves_follow_the_documented_life_cycle(current: TrainingState, to: TrainingState) -> None:
    gatherer = Gatherer(nn.Linear(2, 2), [], _Zero(), _NoValues(), rank=3)
    gatherer.state = current  # the starting point (the move under test is the checked one)
    if (current, to) in _TRAINING_LEGAL:
        gatherer._move(to, "do it")
        assert gatherer.state is to
    else:
        with pytest.raises(UnitError, match=rf"rank 3: the model \(Linear\) cannot do it "
                                            rf"\({current.value} -> {to.value}\).*found {current.value}; forward"):
            gatherer._move(to, "do it")
        assert gatherer.state is current


def test_a_backward_while_the_forward_runs_is_refused() -> None:
    gatherer = Gatherer(nn.Linear(2, 2), [], _Zero(), _NoValues(), rank=0)
    gatherer._begin_pass()
    assert gatherer.state is T.FORWARD
    with pytest.raises(UnitError, match=r"cannot begin a backward \(forward -> backward\)"):
        gatherer._move(T.BACKWARD, "begin a backward")
    with pytest.raises(UnitError, match=r"cannot begin a forward \(forward -> forward\)"):
        gatherer._begin_pass()


class _Zero:
    stage3_prefetch_bucket_size = 0
    stage3_max_live_parameters = 0
    stage3_max_reuse_distance = 0


class _NoValues:
    def on_params_modified(self, unit: Unit) -> None:
        pass

    def on_written(self, unit: Unit) -> None:
        pass

    def on_values_loaded(self, unit: Unit, values: torch.Tensor, loaded: set[int]) -> None:
        pass
