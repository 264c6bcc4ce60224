"""``python -m benchmarks.pipeline`` at the tiny size, so it never rots.

Times are reported by the benchmark, never asserted here; the test checks the
report is complete and the parameter bytes add up: the two stages together
hold the unsplit model plus one extra copy of the tied embedding.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `benchmarks` is a top-level package next to src/

from benchmarks.pipeline import main


def test_pipeline_benchmark_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "pipeline.json"
    assert main(["--size", "tiny", "--micro-batches", "1", "2", "--warmup", "0", "--steps", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| 1 | " in text and "| 2 | " in text and "(S-1)/(M+S-1)" in text
    ranks = json.loads(out.read_text())["ranks"]
    assert [r["stage"] for r in ranks] == [0, 1]
    assert [len(r["rows"]) for r in ranks] == [2, 2]
    assert all(0.0 <= idle <= 1.0 for r in ranks for row in r["rows"] for idle in row["idle"])
    assert not ranks[0]["rows"][0]["stage0_ms"] and ranks[0]["rows"][1]["stage0_ms"]  # stage 0 needs M even
    unsplit = ranks[0]["param_bytes"]["unsplit"]
    tied = 256 * 64 * 4  # the tiny GPT's token embedding, fp32, held by both stages
    assert sum(r["param_bytes"]["pipeline"] for r in ranks) == unsplit + tied
