"""Faults of optimizer offload to NVMe (docs/offload.md): each is a clear error at `initialize`, or cleaned up.

An unwritable or too-small `nvme_path` fails before any training step, naming the rank, the path, the bytes
needed and the fix; offload at a stage that does not shard what it offloads is a config error; this rank's folder is
gone after `engine.destroy()` and after a process that never called it exits.  One process each, so fast.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from _faults_common import record_row
from _parity import make_model

import shardwise
from shardwise.config import ConfigError

#: seconds a refusal at initialize may take (measured ~0.05 s; a loaded 2-core host is slower)
LIMIT_S = 5.0


def _initialize(nvme: str, stage: int = 2, section: str = "offload_optimizer") -> Any:
    model = make_model()
    zero = {"stage": stage, section: {"device": "nvme", "nvme_path": nvme}}
    return shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), {"zero_optimization": zero})


def _refusal(action: Callable[[], Any], error: type[Exception]) -> tuple[str, float]:
    start = time.perf_counter()
    with pytest.raises(error) as info:
        action()
    seconds = time.perf_counter() - start
    assert seconds < LIMIT_S, f"{seconds:.2f} s to refuse"
    return str(info.value), seconds


def test_an_unwritable_nvme_path_is_an_error_at_initialize(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    message, seconds = _refusal(lambda: _initialize(str(blocker / "nvme")), RuntimeError)
    assert message.startswith("rank 0: cannot make this rank's offload folder under "
                              "`zero_optimization.offload_optimizer.nvme_path`"), message
    assert "set `zero_optimization.offload_optimizer.nvme_path` to a writable directory" in message
    record_row("misuse", "`offload_optimizer.nvme_path` is not writable", "1-2",
               "`RuntimeError` at `initialize` naming the rank, the path and the fix", seconds)


def test_a_too_small_nvme_path_is_an_error_before_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = shutil.disk_usage
    # a disk with 10 kB free: the parity model's fp32 masters and Adam state need 12 bytes x 2232 elements
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=10_000))
    message, seconds = _refusal(lambda: _initialize(str(tmp_path)), RuntimeError)
    assert "has 10,000 bytes free and this rank's offloaded optimizer state needs 26,784" in message, message
    assert "point `zero_optimization.offload_optimizer.nvme_path` at a larger disk" in message
    assert list(tmp_path.iterdir()) == [], "the refused engine's folder is removed"
    record_row("misuse", "`offload_optimizer.nvme_path` has too little free space", "1-2",
               "`RuntimeError` at `initialize` with bytes free and needed (`shutil.disk_usage`)", seconds)


@pytest.mark.parametrize("stage,section,says", [
    (0, "offload_optimizer", "needs ZeRO stage 1, 2 or 3, and this is stage 0"),
    (2, "offload_param", "`zero_optimization.offload_param.device: nvme` needs ZeRO stage 3, and this is stage 2"),
])
def test_offload_at_a_stage_without_it_is_a_config_error(tmp_path: Path, stage: int, section: str, says: str) -> None:
    message, seconds = _refusal(lambda: _initialize(str(tmp_path), stage, section), ConfigError)
    assert says in message, message
    record_row("misuse", f"`{section}: {{device: nvme}}` at stage {stage} (nothing of it sharded there)", str(stage),
               "`ConfigError` naming the key and the fix", seconds)


def test_files_are_removed_at_destroy(tmp_path: Path) -> None:
    engine = _initialize(str(tmp_path))
    folder = engine.strategy.store.home.files.folder
    assert folder.parent == tmp_path and any(folder.iterdir())
    engine.destroy()
    assert list(tmp_path.iterdir()) == []


_NO_DESTROY = """
import sys, torch, shardwise
model = torch.nn.Linear(8, 4)
config = {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": sys.argv[1]}}}
engine = shardwise.initialize(model, torch.optim.AdamW(model.parameters()), config)
engine.backward(engine(torch.ones(2, 8)).sum())
engine.step()
print(engine.strategy.store.home.files.folder, flush=True)
"""


def test_files_are_removed_when_a_process_exits_without_destroy(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _NO_DESTROY, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    folder = Path(done.stdout.strip().splitlines()[-1])
    assert folder.parent == tmp_path, done.stdout
    assert not folder.exists() and list(tmp_path.iterdir()) == []


_FORKED_CHILD_EXITS = """
import os, sys
from shardwise.zero.offload.files import NvmeFiles
files = NvmeFiles(sys.argv[1], 0)
child = os.fork()
if child == 0:
    sys.exit(0)  # runs the exit handlers it inherited, the folder's removal among them
os.waitpid(child, 0)
print(files.folder.exists(), flush=True)
"""


def test_a_forked_child_that_exits_leaves_its_parents_folder(tmp_path: Path) -> None:
    """The removal at exit is the creating process's only: a forked child (a data-loader worker, a
    `subprocess` helper) inherits the exit handler, and running it would delete the live parent's state."""
    done = subprocess.run([sys.executable, "-c", _FORKED_CHILD_EXITS, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True"], done.stdout
    assert list(tmp_path.iterdir()) == [], "the parent still removed its folder at its own exit"
