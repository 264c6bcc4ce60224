"""The benchmark runner (``python -m benchmarks.run``) at the tiny size, so it never rots.

One launch runs every system once (``--isolation round``) to stay well under a
minute; the test checks the files are written, every system finished, all of
them trained the same thing (losses agree at the stated tolerances), and the
byte counts shardwise reports match ZeRO theory.  Times are reported by the
runner, never asserted here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `benchmarks` is a top-level package next to src/

from benchmarks.chart import comparison_chart
from benchmarks.configs import System, available_stages, comparison_systems
from benchmarks.run import main
from benchmarks.schedule import interleaved
from benchmarks.theory import comm_bytes, state_bytes

# Largest per-step loss difference against ddp-fp32.  fp32: same math, only the
# kernels' summation order differs.  bf16: the loss itself is rounded to bf16
# (spacing 1/32 near 5.5) and DDP's autocast keeps some ops in fp32.
FP32_TOLERANCE = 1e-4
BF16_TOLERANCE = 6e-2


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    out = tmp_path_factory.mktemp("bench")
    argv = ["--size", "tiny", "--warmup", "1", "--steps", "2", "--rounds", "1", "--isolation", "round",
            "--timeout", "30", "--no-chart", "--out", str(out)]
    return out, main(argv)


def _result(out: Path) -> dict[str, Any]:
    return json.loads((out / "comparison.json").read_text())


def test_runner_writes_markdown_and_json(smoke: tuple[Path, int]) -> None:
    out, code = smoke
    assert code == 0, (out / "comparison.md").read_text() if (out / "comparison.md").exists() else "no output"
    text = (out / "comparison.md").read_text()
    assert "### shardwise against its torch peer" in text
    result = _result(out)
    expected = {s.name for s in comparison_systems(available_stages())}
    assert {s["name"] for s in result["systems"]} == expected
    assert [s["name"] for s in result["systems"] if "error" in s] == []
    assert len(result["comparisons"]) == 2 * len(available_stages())
    for row in result["comparisons"]:
        assert row["time_ratio"] > 0 and row["state_ratio"] > 0


def test_every_system_trains_the_same_thing(smoke: tuple[Path, int]) -> None:
    systems = {s["name"]: s for s in _result(smoke[0])["systems"]}
    reference = systems["ddp-fp32"]["loss_curve"]
    assert reference[-1] < reference[0]  # it does learn
    for name, summary in systems.items():
        tolerance = FP32_TOLERANCE if summary["dtype"] == "fp32" else BF16_TOLERANCE
        diff = max(abs(a - b) for a, b in zip(summary["loss_curve"], reference))
        assert diff <= tolerance, f"{name}: loss differs from ddp-fp32 by {diff:.2e} (tolerance {tolerance})"


def test_counted_bytes_match_theory(smoke: tuple[Path, int]) -> None:
    result = _result(smoke[0])
    for summary in result["systems"]:
        if summary["family"] == "shardwise" and summary["stage"] < 3:
            # Exact up to bucket padding and the one-scalar gradient-norm all-reduce.
            assert summary["sent_vs_theory"] == pytest.approx(1.0, abs=0.01), summary["name"]
        if summary["family"] == "shardwise":
            # Stage 3 keeps small parameters whole, so it may send less, never more.
            assert summary["sent_vs_theory"] <= 1.01, summary["name"]
    ddp = next(s for s in result["systems"] if s["name"] == "ddp-fp32")
    # Plain DDP holds exactly 16 bytes per parameter (+ Adam's step counters).
    assert ddp["state_vs_theory"] == pytest.approx(1.0, abs=1e-3)


def test_interleaving_alternates_direction() -> None:
    a, b, c = (System("shardwise", s, "fp32") for s in range(3))
    order = [s for _, s in interleaved([a, b, c], 3)]
    assert order == [a, b, c, c, b, a, a, b, c]


def test_theory_matches_zero_paper() -> None:
    psi, n = 1000, 4
    f = (n - 1) / n
    for stage in (0, 1, 2):
        assert comm_bytes(System("shardwise", stage, "fp32"), psi, n, "nccl") == pytest.approx(2 * psi * f * 4)
    assert comm_bytes(System("shardwise", 3, "fp32"), psi, n) == pytest.approx(3 * psi * f * 4)
    # gloo's sockets: stages 1-2 all-reduce (2 reductions' worth) and then gather; shared memory: reduce-scatter
    assert comm_bytes(System("shardwise", 1, "fp32"), psi, n) == pytest.approx(3 * psi * f * 4)
    assert comm_bytes(System("shardwise", 1, "fp32"), psi, n, "shared memory") == pytest.approx(2 * psi * f * 4)
    assert comm_bytes(System("shardwise", 1, "fp32"), psi, 1) == 0.0
    assert sum(state_bytes(0, "fp32", psi, n).values()) == 16 * psi
    assert sum(state_bytes(3, "fp32", psi, n).values()) == 16 * psi / n
    assert sum(state_bytes(1, "bf16", psi, n).values()) == 4 * psi + 12 * psi / n


def test_chart_is_skipped_without_matplotlib(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    messages: list[str] = []
    assert comparison_chart({"systems": []}, tmp_path / "c.png", log=messages.append) is False
    assert "matplotlib" in messages[0] and not (tmp_path / "c.png").exists()
