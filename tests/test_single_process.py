"""World size 1: no torchrun, no environment variables, no process group set up by the user."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")

SCRIPT = textwrap.dedent(
    """
    import torch, shardwise
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    for stage in (0, 1, 2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        engine = shardwise.initialize(model, config={
            "train_micro_batch_size_per_gpu": 64,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "zero_optimization": {"stage": stage},
        })
        first = None
        for _ in range(30):
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            first = first if first is not None else loss.item()
        assert loss.item() < 0.7 * first, (stage, first, loss.item())
        print(f"stage {stage}: {first:.4f} -> {loss.item():.4f}")
    print("OK world", torch.distributed.get_world_size())
    """
)


def test_world_size_one_without_launcher(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"}}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "OK world 1" in done.stdout
