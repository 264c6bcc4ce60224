"""A load applies nothing until every part of the checkpoint is read, decoded and checked.

Each case tampers with one plain-data part of a real checkpoint (what a damaged
or crafted manifest could hold) and requires a `CheckpointError` on every rank
with the engine left bit-for-bit as it was: weights, optimizer state, loss
scaler, learning rate and counters.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch.distributed as dist
from _checkpoint_common import assert_same, snapshot, train
from _parity import adamw, make_model

import shardwise
from shardwise.checkpoint import CheckpointError
from shardwise.testing import distributed_test, run_subtests


def _engine(stage: int) -> Any:
    model = make_model()
    config = {"zero_optimization": {"stage": stage}, "fp16": {"enabled": True, "initial_scale_power": 8}}
    return shardwise.initialize(model, adamw(model.parameters()), config)


def _state(engine: Any) -> dict[str, Any]:
    counters = (engine.global_steps, engine.micro_steps, engine.skipped_steps)
    return {**snapshot(engine), "scaler": engine.precision.scaler.state_dict(), "lr": engine.get_lr(),
            "counters": counters}


def _edit_manifest(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    manifest = json.loads((path / "shardwise.json").read_text())
    edit(manifest)
    (path / "shardwise.json").write_text(json.dumps(manifest))


def _scaler(manifest: dict[str, Any]) -> dict[str, Any]:
    scaler: dict[str, Any] = manifest["precision"]["scaler"]
    return scaler


_TAMPER: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    # an extra counter would set an arbitrary engine attribute
    "counter key": (lambda m: m["counters"].update(gradient_accumulation_steps=1000000), "counters"),
    "negative counter": (lambda m: m["counters"].update(global_steps=-5), "counters"),
    # a "dtype" that names a torch function instead of a number
    "scaler callable": (lambda m: _scaler(m).update(scale={"__dtype__": "float32"}), "precision"),
    "scaler key": (lambda m: _scaler(m).update(hook=1), "precision"),
    "lr as text": (lambda m: m["optimizer"]["param_groups"][0].update(lr="0.5"), "param_groups"),
    "param group key": (lambda m: m["optimizer"]["param_groups"][0].update(foreach_hack=3), "param_groups"),
}


@distributed_test(world_size=2, timeout=180)
def test_refused_checkpoint_changes_nothing(tmp_path: Path) -> None:
    def case(stage: int, tamper: str) -> None:
        edit, field = _TAMPER[tamper]
        root = tmp_path / f"stage{stage}-{tamper.replace(' ', '_')}"
        engine = _engine(stage)
        train(engine, 0, 2)
        saved = Path(engine.save_checkpoint(root))
        train(engine, 2, 1)  # the engine moves on: a load that applied anything would show
        before = _state(engine)
        dist.barrier()
        if dist.get_rank() == 0:
            _edit_manifest(saved, edit)
        dist.barrier()
        with pytest.raises(CheckpointError, match=field):
            engine.load_checkpoint(root)
        assert_same(_state(engine), before, f"after refusing `{tamper}`")
        engine.destroy()

    run_subtests(case, [{"stage": s, "tamper": t} for s in (1, 3) for t in _TAMPER])
