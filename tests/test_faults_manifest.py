"""A checkpoint's manifest is checked whole: a file without a checksum in it is an error, never a skipped check.

The manifest (``shardwise.json``) lists every file of the checkpoint with its
size and SHA-256.  A manifest that lost its whole ``files`` entry, or one file's
entry, used to turn the check of those files off: a flipped byte in a tensor
file then loaded and consolidated without a word (exit 0).  Now every file a
load or a consolidation reads must be listed, or the load fails on every rank,
and ``shardwise checkpoint consolidate`` exits 2, naming the file; a checkpoint
as the current code writes it still loads, to the weights it saved.
"""

from __future__ import annotations

import functools
import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from _faults_common import make_engine, outcome, record_row, train_step

from shardwise.checkpoint import CheckpointError, consolidated_state_dict
from shardwise.cli.commands import main
from shardwise.testing import run_distributed

TAG = "good"
SHARD = "__1_0.distcp"


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _change_a_digit(path: Path) -> None:
    """Still valid JSON, one digit of the RNG state changed."""
    text = path.read_text()
    index = next(i for i in range(len(text) // 2, len(text)) if text[i] in "12345678")
    path.write_text(text[:index] + str(int(text[index]) + 1) + text[index + 1 :])


def _lose(name: str) -> Callable[[dict[str, Any]], None]:
    return lambda manifest: manifest["files"].pop(name)


#: case -> (what the manifest loses, the file damaged with it and how, what the error must name)
CASES: dict[str, tuple[Callable[[dict[str, Any]], None], str, Callable[[Path], None], str]] = {
    "the manifest lost its `files` entry": (lambda m: m.pop("files"), SHARD, _flip, "`files`"),
    f"the manifest lost `{SHARD}`'s entry": (_lose(SHARD), SHARD, _flip, SHARD),
    "the manifest lost `rank1.json`'s entry": (_lose("rank1.json"), "rank1.json", _change_a_digit, "rank1.json"),
    "the manifest lost `.metadata`'s entry": (_lose(".metadata"), ".metadata", lambda path: None, ".metadata"),
}


def damaged_copy(root: Path, index: int, case: str) -> Path:
    """A copy of the checkpoint in ``root`` with the manifest and one file damaged as ``case`` says."""
    lose, name, damage, _ = CASES[case]
    copy = root.parent / f"damaged{index}"
    shutil.copytree(root, copy)
    manifest = copy / TAG / "shardwise.json"
    data = json.loads(manifest.read_text())
    lose(data)
    manifest.write_text(json.dumps(data))
    damage(copy / TAG / name)
    return copy


def _weights(engine: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for group in engine.optimizer.inner.param_groups for p in group["params"]]


def _loads(root: str) -> dict[str, Any]:
    engine = make_engine(2)
    for step in range(2):
        train_step(engine, step)
    engine.save_checkpoint(root, tag=TAG)
    saved = _weights(engine)
    copies = [str(damaged_copy(Path(root), i, case)) if dist.get_rank() == 0 else "" for i, case in enumerate(CASES)]
    dist.broadcast_object_list(copies)
    train_step(engine, 2)
    moved = _weights(engine)
    results = {case: outcome(functools.partial(engine.load_checkpoint, copy, tag=TAG))
               for case, copy in zip(CASES, copies)}
    unchanged = all(torch.equal(a, b) for a, b in zip(moved, _weights(engine)))
    engine.load_checkpoint(root, tag=TAG)  # as the current code writes it: loads, to the weights it saved
    restored = all(torch.equal(a, b) for a, b in zip(saved, _weights(engine)))  # exact: the same bytes
    engine.destroy()
    return {"results": results, "copies": copies, "unchanged": unchanged, "restored": restored}


def test_a_manifest_missing_a_checksum_is_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ranks = run_distributed(_loads, 2, args=(str(tmp_path / "ckpt"),), timeout=180)
    copies = ranks[0]["copies"]
    for rank, report in enumerate(ranks):
        assert report["restored"] and report["unchanged"], (rank, report)
        for case, result in report["results"].items():
            named = CASES[case][3]
            assert result["error"] == "CheckpointError" and named in result["message"], (rank, case, result)
            assert "shardwise.json" in result["message"] or "manifest" in result["message"], result
    consolidation = {}
    for case, copy in zip(CASES, copies):
        start = time.monotonic()
        with pytest.raises(CheckpointError, match=CASES[case][3].replace(".", r"\.")):
            consolidated_state_dict(copy, tag=TAG)
        consolidation[case] = time.monotonic() - start
        out = tmp_path / "out.safetensors"
        assert main(["checkpoint", "consolidate", copy, "--tag", TAG, "--out", str(out)]) == 2
        assert CASES[case][3] in capsys.readouterr().err and not out.exists()
    for case in CASES:
        seconds = max(report["results"][case]["seconds"] for report in ranks)
        record_row("checkpoint", f"{case} (a file damaged with it: `{CASES[case][1]}`)", "2",
                   "`load_checkpoint` raises `CheckpointError` on every rank naming the file (the engine is "
                   "unchanged); `consolidated_state_dict` raises and `shardwise checkpoint consolidate` exits 2 "
                   f"the same way (consolidation: {consolidation[case]:.2f} s)", seconds)
