"""``benchmarks.cuda`` (the one-GPU NCCL comparison) keeps working where no GPU is.

The suite has no GPU, so the same code runs with ``--device cpu`` on one gloo
rank: every stage beside its torch peer, losses within tolerance, the
checkpoint round trip bit-identical, state counted, GPU memory reported as
n/a; and each system alone in its own process beside the paired run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.peaks import bf16_peak, step_flops

TINY = ["--device", "cpu", "--size", "tiny", "--steps", "2", "--warmup", "1", "--dtypes", "fp32", "--deepspeed", "off"]


def _bench(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "benchmarks.cuda", *TINY, "--out", str(tmp_path), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_cuda_benchmark_pairs_every_stage_on_cpu(tmp_path: Path) -> None:
    done = _bench(tmp_path, "--stages", "0", "1", "2", "3", "--isolation", "pair")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "cuda.json").read_text())
    rows = report["rows"]
    assert [r["system"] for r in rows] == [
        "shardwise-s0-fp32", "ddp-fp32", "shardwise-s1-fp32", "zero1-fp32",
        "shardwise-s2-fp32", "fsdp2-noreshard-fp32", "shardwise-s3-fp32", "fsdp2-reshard-fp32"]
    for row in rows:
        assert row["error"] is None and row["ms"] > 0 and row["alone_ms"] is None
        assert row["state_mib"] > 0 and row["tflops"] > 0
        # no GPU: no GPU memory figure and no card peak, said as n/a rather than 0
        assert row["step_peak_mib"] is None and row["peak_mib"] is None and row["pct_bf16_peak"] is None
        if row["family"] == "shardwise":
            assert row["checkpoint_ok"] is True
        else:  # one rank, fp32, same seed and batches: the peer's losses to fp32 rounding (1e-4 relative)
            assert row["max_rel_loss_diff"] <= 1e-4 and row["loss_ok"] and row["ratio"] > 0
    assert report["bf16_peak_tflops"] is None and report["step_flops"] == step_flops("tiny", {}, 8, 0)
    table = (tmp_path / "cuda.md").read_text()
    assert "| 3 | fp32 | fsdp2-reshard-fp32 |" in table and "6·N + 12·L·T·d" in table


def test_a_system_alone_in_its_own_process() -> None:
    from benchmarks.configs import System
    from benchmarks.cuda import _alone_in_a_process

    alone = _alone_in_a_process([*TINY, "--isolation", "process"], System("shardwise", 3, "fp32"), timeout=240)
    assert alone.error is None, alone.error
    assert alone.system == "shardwise-s3-fp32" and len(alone.times) == 1 + 2 and len(alone.losses) == 1 + 2 + 1
    assert alone.state_mib is not None and alone.state_mib > 0 and alone.peak_mib is None  # n/a on the CPU


def test_deepspeed_on_without_deepspeed_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import benchmarks.cuda as cuda

    monkeypatch.setattr(cuda, "deepspeed_installed", lambda: False)  # as on a machine without it, wherever this runs
    assert cuda._with_deepspeed("off") is False and cuda._with_deepspeed("auto") is False
    with pytest.raises(SystemExit, match="DeepSpeed is not installed here"):
        cuda._with_deepspeed("on")
    monkeypatch.setattr(cuda, "deepspeed_installed", lambda: True)
    assert cuda._with_deepspeed("on") is True and cuda._with_deepspeed("auto") is True
    assert cuda._with_deepspeed("off") is False


def test_bf16_peaks_by_device_name_and_the_flops_formula() -> None:
    assert bf16_peak("NVIDIA H100 80GB HBM3") == 989.4
    assert bf16_peak("NVIDIA H100 PCIe") == 756.5
    assert bf16_peak("NVIDIA H200") == 989.4
    assert bf16_peak("NVIDIA A100-SXM4-80GB") == bf16_peak("NVIDIA A100 80GB PCIe") == 312.0
    assert bf16_peak("NVIDIA GeForce RTX 4090") is None
    # 6·N + 12·L·T·d per token, times the tokens: GPT tiny (L 2, d 64, T 64), N counted by the model
    from benchmarks.workload import model_numel

    n = model_numel("tiny")
    assert step_flops("tiny", {}, 8, 0) == (6 * n + 12 * 2 * 64 * 64) * 8 * 64
    assert step_flops("tiny", {}, 2, 32) == (6 * n + 12 * 2 * 32 * 64) * 2 * 32
