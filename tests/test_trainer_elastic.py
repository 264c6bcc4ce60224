"""Elastic: a rank SIGKILLed mid-run, torchrun restarts the group, the Trainer resumes from `latest`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from _trainer_job import train_job

from shardwise.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
JOB = Path(__file__).resolve().parent / "_trainer_job.py"


def test_killed_rank_restarts_and_resumes_to_the_uninterrupted_weights(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    out = tmp_path / "elastic.pt"
    # Rank 1 dies at step 5, after the step-4 checkpoint and before the step-6 one.
    launch = subprocess.run(
        [sys.executable, "-m", "shardwise.cli", "run", "--max-restarts", "3", "--nproc-per-node", "2",
         str(JOB), str(tmp_path / "elastic"), str(out), "5"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert launch.returncode == 0, launch.stdout[-3000:] + launch.stderr[-5000:]
    assert "resumed from" in launch.stdout and "global_step4" in launch.stdout, launch.stdout[-3000:]
    got = torch.load(out, weights_only=True)
    assert got["restarts"] == "1"  # torchrun restarted the group once

    run_distributed(train_job, 2, args=(str(tmp_path / "plain"), str(tmp_path / "plain.pt")), timeout=120)
    want = torch.load(tmp_path / "plain.pt", weights_only=True)
    assert got["loss"] == want["loss"]
    for name, value in want["weights"].items():  # fp32: bit for bit
        assert torch.equal(got["weights"][name], value), f"{name} differs from the uninterrupted run"
