"""examples/lightning_gpt.py, briefly, through the README's command on 2 CPU ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_lightning_gpt_example_trains_saves_and_consolidates(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    run = tmp_path / "run"
    args = ["--size", "tiny", "--steps", "4", "--data-bytes", "100000", "--run-dir", str(run), "--sample-tokens", "16"]
    done = subprocess.run([sys.executable, "-m", "shardwise.cli", "run", "--nproc-per-node", "2",
                           "examples/lightning_gpt.py", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "GPT tiny, 2 ranks, ZeRO stage 3, 32-true: step 4" in out, out
    assert "--- sample from last-fp32.ckpt ---" in out, out
    assert (run / "last.ckpt" / "checkpoint").is_dir()
    saved = torch.load(run / "last-fp32.ckpt", weights_only=True)
    assert saved["global_step"] == 4 and saved["hyper_parameters"]["size"] == "tiny"
    weights = saved["state_dict"]
    assert weights["model.wte.weight"].dtype == torch.float32 and weights["model.wte.weight"].shape == (256, 64)
