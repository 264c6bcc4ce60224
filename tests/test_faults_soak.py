"""The soak benchmark (``python -m benchmarks.soak``), short: memory and live tensors stay flat at every stage.

The benchmark runs 2,000 steps per stage (``docs/faults.md`` has its figures);
here 100 per stage in one launch (sequences of 16 tokens): after a warm-up of 40 steps resident memory
grows less than 2% and the number of live tensors does not grow.  Step times are
reported by the benchmark, not asserted (this machine is shared).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `benchmarks` is a top-level package next to src/

from _faults_common import record_row  # noqa: E402

from benchmarks.soak import soak_stages_in_rank, summarize  # noqa: E402
from shardwise.testing import run_distributed  # noqa: E402

STEPS = 100
WARMUP = 0.4


def test_short_soak_keeps_memory_and_tensors_flat() -> None:
    per_rank = run_distributed(soak_stages_in_rank, 2, args=((0, 1, 2, 3), STEPS, WARMUP, 10, "tiny", 16),
                               timeout=300)
    rows = [summarize(r) for results in per_rank for r in results]
    for row in rows:
        assert row["rss_growth_pct"] < 2.0, row
        assert row["tensors_at_end"] <= row["tensors_after_warmup"], row
    for stage in range(4):
        mine = [r for r in rows if r["stage"] == stage]
        record_row("soak", f"{STEPS} steps, tiny GPT (test); 2,000 in `benchmarks.soak`", str(stage),
                   f"resident memory +{max(r['rss_growth_pct'] for r in mine):.2f}% after warm-up, live tensors "
                   f"{max(r['tensors_at_end'] - r['tensors_after_warmup'] for r in mine):+d}", None)
