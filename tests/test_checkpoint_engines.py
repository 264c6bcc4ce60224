"""Checkpoints of several engines: one tag, a subdirectory per engine, one `latest`, committed together."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from _checkpoint_common import assert_same, full_params, snapshot, train
from _parity import adamw, make_model

import shardwise
from shardwise.checkpoint import CheckpointError
from shardwise.testing import distributed_test, run_subtests


def _student(seed: int = 0, name: str = "student", group: Any = None, stage: int = 2) -> Any:
    model = make_model(seed)
    return shardwise.initialize(model, adamw(model.parameters()), {"zero_optimization": {"stage": stage}},
                                process_group=group, name=name)


def _teacher(seed: int = 9, name: str = "teacher") -> Any:
    config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    return shardwise.initialize(make_model(seed), None, config, name=name)


@distributed_test(world_size=2, timeout=180)
def test_save_and_load_two_engines_together(tmp_path: Path) -> None:
    student, teacher = _student(), _teacher()
    train(student, 0, 2)
    saved = Path(shardwise.save_checkpoints(tmp_path, {"student": student, "teacher": teacher},
                                            client_state={"epoch": 3}))
    assert saved == tmp_path / "global_step2", saved
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert json.loads((saved / "engines.json").read_text())["engines"] == ["student", "teacher"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")], "nothing left behind"
    want = {"student": snapshot(student), "teacher": teacher.full_state_dict()}
    student.destroy()
    teacher.destroy()

    student, teacher = _student(seed=5), _teacher(seed=6)
    path, client = shardwise.load_checkpoints(tmp_path, {"student": student, "teacher": teacher})
    assert (path, client) == (str(saved), {"epoch": 3}), (path, client)
    assert_same(snapshot(student), want["student"], "student")
    assert_same(teacher.full_state_dict(), want["teacher"], "teacher")
    assert student.global_steps == 2
    student.destroy()
    teacher.destroy()


@distributed_test(world_size=2, timeout=180)
def test_named_engines_saving_alone_never_clobber(tmp_path: Path) -> None:
    student, teacher = _student(), _teacher()
    train(student, 0, 1)
    student.save_checkpoint(tmp_path, tag="run")
    teacher.save_checkpoint(tmp_path, tag="run")  # added next to the student's, which stays
    train(student, 1, 1)
    student.save_checkpoint(tmp_path, tag="run")  # replaces only the student's files
    assert json.loads((tmp_path / "run" / "engines.json").read_text())["engines"] == ["student", "teacher"]
    want_student, want_teacher = snapshot(student), teacher.full_state_dict()

    fresh_student, fresh_teacher = _student(seed=5), _teacher(seed=6)
    assert fresh_student.load_checkpoint(tmp_path)[0] == str(tmp_path / "run" / "student")
    fresh_teacher.load_checkpoint(tmp_path)
    assert_same(snapshot(fresh_student), want_student, "student")
    assert_same(fresh_teacher.full_state_dict(), want_teacher, "teacher")

    def refused(engine: Any, match: str) -> None:
        with pytest.raises(CheckpointError, match=match):
            engine.load_checkpoint(tmp_path)
        engine.destroy()

    model = make_model()
    unnamed = shardwise.initialize(model, adamw(model.parameters()), {})
    run_subtests(refused, [
        {"engine": unnamed, "match": r"several engines \['student', 'teacher'\]; build this engine"},
        {"engine": _student(name="critic"), "match": r"engines \['student', 'teacher'\], not of `critic`"},
    ])
    for engine in (student, teacher, fresh_student, fresh_teacher):
        engine.destroy()


@distributed_test(world_size=2, timeout=180)
def test_a_failed_engine_commits_nothing(tmp_path: Path) -> None:
    student, teacher = _student(), _teacher()
    shardwise.save_checkpoints(tmp_path, {"student": student, "teacher": teacher}, tag="good")
    with pytest.raises(CheckpointError, match="client_state"):  # an object that needs pickle: refused on rank 0
        shardwise.save_checkpoints(tmp_path, {"student": student, "teacher": teacher}, tag="bad",
                                   client_state={"callback": object()})
    dist.barrier()  # rank 0 removes what the failed save left once every rank is past it
    assert not (tmp_path / "bad").exists() and (tmp_path / "latest").read_text() == "good"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    student.destroy()
    teacher.destroy()


@distributed_test(world_size=4, timeout=240)
def test_engines_on_subgroups_save_together(tmp_path: Path) -> None:
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = f"pair{rank // 2}"
    pair, world = _student(seed=rank // 2, name=mine, group=pairs[rank // 2]), _student(seed=7, name="world", stage=1)
    train(pair, 0, 1)
    train(world, 0, 1)
    with pytest.raises(CheckpointError, match="different engines, give them different names"):
        shardwise.save_checkpoints(tmp_path / "clash", {"pair": pair, "world": world})
    saved = Path(shardwise.save_checkpoints(tmp_path / "ok", {mine: pair, "world": world}))
    assert json.loads((saved / "engines.json").read_text())["engines"] == ["pair0", "pair1", "world"]
    # (snapshot's optimizer state gathers over the world: use it for the world engine only)
    want_pair, want_world = full_params(pair), snapshot(world)
    fresh_pair = _student(seed=9, name=mine, group=pairs[rank // 2])
    fresh_world = _student(seed=9, name="world", stage=1)
    shardwise.load_checkpoints(tmp_path / "ok", {mine: fresh_pair, "world": fresh_world})
    assert_same(full_params(fresh_pair), want_pair, "pair after load")
    assert_same(snapshot(fresh_world), want_world, "world after load")
    for engine in (pair, world, fresh_pair, fresh_world):
        engine.destroy()
