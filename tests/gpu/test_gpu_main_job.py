"""The main job on a GPU machine: examples/train_gpt.py through `shardwise run`, and README command 1.

* ``--nproc-per-node 1``: one rank trains on the GPU with NCCL (its first line
  says ``on cuda (nccl)``), evaluates, saves, samples and draws metrics.png.
* README command 1 exactly as written (``shardwise run --nproc-per-node 2
  examples/train_gpt.py``, default size and steps): with one GPU the two ranks
  run on the CPU with gloo and one line on stderr says so
  (src/shardwise/comm/placement.py); with two or more they train on the GPUs.
  It runs in a scratch folder holding a link to ``examples``, so ``runs/``
  lands there.

The CPU cases are tests/test_cli.py's (the same script on 2 gloo ranks).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import _gpu
import pytest

from shardwise.comm.placement import visible_gpus


def _shardwise(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """``shardwise ARGS``: the installed console script where there is one (tests/gpu/run.sh installs it)."""
    exe = shutil.which("shardwise")
    command = [exe] if exe else [sys.executable, "-m", "shardwise.cli"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_gpu.ROOT / "src"), env.get("PYTHONPATH")]))
    return subprocess.run([*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _scratch(tmp_path: Path) -> Path:
    (tmp_path / "examples").symlink_to(_gpu.ROOT / "examples")
    return tmp_path


@pytest.mark.parametrize("device", _gpu.CUDA_ONLY)
def test_train_gpt_on_one_gpu(device: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    done = _shardwise(["run", "--nproc-per-node", "1", "examples/train_gpt.py", "--size", "tiny", "--steps", "20",
                       "--run-dir", str(run), "--eval-every", "10", "--save-every", "10", "--log-every", "5",
                       "--sample-tokens", "20"], _scratch(tmp_path), timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"1 rank(s) on {device} ({'nccl' if device == 'cuda' else 'gloo'})" in done.stdout, done.stdout
    assert "step 20/20" in done.stdout and "eval at step 20: loss" in done.stdout and "--- sample" in done.stdout
    assert {"model.json", "metrics.jsonl", "metrics.png", "checkpoints"} <= {p.name for p in run.iterdir()}


@pytest.mark.parametrize("device", _gpu.CUDA_ONLY)
def test_readme_command_1_as_written(device: str, tmp_path: Path) -> None:
    done = _shardwise(["run", "--nproc-per-node", "2", "examples/train_gpt.py"], _scratch(tmp_path), timeout=420)
    print(done.stdout[-3000:], done.stderr[-3000:], sep="\n--- stderr ---\n")  # the note quotes it (pytest -s)
    assert done.returncode == 0, done.stdout + done.stderr
    gpus = visible_gpus()
    if gpus >= 2:
        assert "2 rank(s) on cuda (nccl)" in done.stdout
    else:  # one GPU: said in one line; none: nothing to say
        note = "shardwise run: 2 ranks asked for (--nproc-per-node 2) but 1 GPU is visible, so the 2 ranks " \
               "run on the CPU with gloo"
        assert (note in done.stderr) == (gpus == 1) and "2 rank(s) on cpu (gloo)" in done.stdout
    assert "Traceback" not in done.stderr and "invalid device ordinal" not in done.stderr
    assert "step 200/200" in done.stdout and "--- sample" in done.stdout
    assert (tmp_path / "runs" / "gpt-small" / "metrics.png").is_file()
