"""The multi-engine examples, end to end on 2 ranks through `shardwise run`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "shardwise.cli", "run", "--nproc-per-node", "2", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_gan_example_trains_two_engines() -> None:
    result = _run("examples/gan.py", "--steps", "60")
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("mean distance"))
    start, end = (float(v) for v in line.split(":")[1].split("->"))
    assert end < 0.85 * start, f"the generator did not move toward the modes: {line}"


def test_distill_example_saves_both_engines(tmp_path: Path) -> None:
    result = _run("examples/distill.py", "--teacher-steps", "20", "--steps", "20", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "bf16, ZeRO-3, inference only" in out and "held-out loss" in out, out
    losses = [float(line.split("| loss")[1].split("|")[0]) for line in out.splitlines() if line.startswith("step ")]
    assert losses[-1] < losses[0], f"the student did not learn: {losses}"
    saved = json.loads((tmp_path / "global_step20" / "engines.json").read_text())
    assert saved["engines"] == ["student", "teacher"]
