"""``benchmarks.cuda`` (the one-GPU NCCL comparison) keeps working where no GPU is.

The suite has no GPU, so the same code runs with ``--device cpu`` on one gloo
rank: every stage beside its torch peer, losses within tolerance, and the
checkpoint round trip bit-identical.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cuda_benchmark_runs_on_cpu(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "benchmarks.cuda", "--device", "cpu", "--size", "tiny", "--steps", "2",
           "--warmup", "1", "--stages", "0", "1", "2", "3", "--dtypes", "fp32", "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads((tmp_path / "cuda.json").read_text())["rows"]
    assert [r["system"] for r in rows] == [f"shardwise-s{s}-fp32" for s in range(4)]
    assert [r["peer"] for r in rows] == ["ddp-fp32", "zero1-fp32", "fsdp2-noreshard-fp32", "fsdp2-reshard-fp32"]
    for row in rows:
        # One rank, fp32, same seed and batches: the peer's losses to fp32 rounding (1e-4 relative).
        assert row["max_rel_loss_diff"] <= 1e-4, row
        assert row["checkpoint_ok"], row
        assert row["ms"] > 0 and row["peer_ms"] > 0
    assert "| shardwise-s3-fp32 | fsdp2-reshard-fp32 |" in (tmp_path / "cuda.md").read_text()
