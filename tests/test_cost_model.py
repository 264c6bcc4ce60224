"""benchmarks.model: the α-β formulas, ZeRO's memory figures, and the scale table (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.collectives import Link, all_gather, all_reduce, reduce_scatter
from benchmarks.model import CLUSTERS, MODELS, Job, memory_per_gpu, model_states, scale_rows, step_time

ROOT = Path(__file__).resolve().parents[1]
LINK = Link("test", alpha=1e-5, beta=1e-9, source="made up")


def test_ring_formulas() -> None:
    n, nbytes = 8, 1e8
    assert reduce_scatter(nbytes, n, LINK) == pytest.approx(7 * 1e-5 + 7 / 8 * nbytes * 1e-9)
    assert all_reduce(nbytes, n, LINK) == pytest.approx(reduce_scatter(nbytes, n, LINK) + all_gather(nbytes, n, LINK))
    assert all_reduce(nbytes, n, LINK, buckets=10) - all_reduce(nbytes, n, LINK) == pytest.approx(9 * 14 * 1e-5)
    assert all_reduce(nbytes, 1, LINK) == 0.0


def test_memory_reproduces_the_zero_paper() -> None:
    # Rajbhandari et al., Figure 1: 7.5B parameters, K = 12, N_d = 64
    paper = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.88}
    for stage, gb in paper.items():
        assert model_states(7.5e9, stage, 64) / 1e9 == pytest.approx(gb, abs=0.05)


def test_memory_orders_and_scales_as_zero_says() -> None:
    job = Job(MODELS["1.3B"])
    for n in (8, 64, 1024):
        totals = [sum(memory_per_gpu(job, stage, n).values()) for stage in range(4)]
        assert totals == sorted(totals, reverse=True), (n, totals)
    per_gpu = [memory_per_gpu(job, 3, n)["parameters"] for n in (8, 64, 1024)]
    assert per_gpu[0] > per_gpu[1] > per_gpu[2]
    assert memory_per_gpu(job, 0, 8)["parameters"] == memory_per_gpu(job, 0, 1024)["parameters"]


def test_step_time_parts_and_overlap() -> None:
    cluster = CLUSTERS["h100-ib400"]
    job = Job(MODELS["1.3B"], sequences=4)
    parts = step_time(job, 3, 64, cluster)
    assert parts["total"] == pytest.approx(parts["compute"] + parts["optimizer"] + parts["copies"] + parts["host"]
                                           + parts["exposed_comm"])
    assert parts["host"] == 0.0, "no host term for the GPU presets"
    # more GPUs: no less exposed communication for stage 0 (its all-reduce does not shrink)
    assert step_time(job, 0, 1024, cluster)["exposed_comm"] >= step_time(job, 0, 8, cluster)["exposed_comm"]
    # the 13B model does not fit at stage 0 anywhere, and fits at stage 3 from 8 GPUs on
    rows = scale_rows(cluster)
    thirteen = [r for r in rows if r["model"] == "13B"]
    assert not any(r["fits"] for r in thirteen if r["stage"] == 0)
    assert all(r["fits"] for r in thirteen if r["stage"] == 3)


def test_cli_renders_the_table_and_validates(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.model", "--table", "--zero-paper"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "| 13B | 1,024 |" in done.stdout and "| 3 | 1.88 |" in done.stdout
    scaling = {"micro_batch": 1, "points": [
        {"size": "small", "world_size": 2, "stage": s, "step_s": {"median": 0.02}} for s in range(4)]}
    (tmp_path / "scaling.json").write_text(json.dumps(scaling))
    done = subprocess.run([sys.executable, "-m", "benchmarks.model", "--validate", str(tmp_path / "scaling.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "| small | 2 | 3 |" in done.stdout, done.stdout + done.stderr


def test_calibration_fit_recovers_alpha_and_beta() -> None:
    from benchmarks.calibrate import _fit

    alpha, beta, n = 3e-4, 1 / 1.5e9, 2
    points = [(s, 2 * (n - 1) * alpha + 2 * (n - 1) / n * s * beta) for s in (1 << 14, 1 << 18, 1 << 22, 1 << 26)]
    got_alpha, got_beta = _fit(points, n)
    assert got_alpha == pytest.approx(alpha, rel=1e-6) and got_beta == pytest.approx(beta, rel=1e-6)


def _measured_here() -> tuple[list[list[tuple[int, float]]], float]:
    from benchmarks.calibrate import measure_collectives, measure_host_overhead, measure_shared_memory
    from benchmarks.collectives import Link
    from benchmarks.model import Cluster, Device

    collectives = [measure_collectives([1 << 12, 1 << 16], repeats=2),
                   measure_shared_memory([1 << 12, 1 << 16], repeats=2)]
    # at an absurd FLOP rate, bandwidth and link speed the model explains nothing: all of the step is host work
    instant = Link("instant", 0.0, 0.0, "test")
    cluster = Cluster("instant", Device("instant", 1e30, 1e12, 1e30, "test"), 2, instant, instant, overlaps=False)
    return collectives, measure_host_overhead(3, cluster)


def test_calibration_measures_on_two_ranks() -> None:
    """gloo's sockets and shared memory, on every rank; and the host term from an engine on the ranks."""
    from shardwise.testing import run_distributed

    for both, host in run_distributed(_measured_here, world_size=2, timeout=120):
        for points in both:
            assert [size for size, _ in points] == [1 << 12, 1 << 16]
            assert all(seconds > 0 for _, seconds in points)
        assert host > 0
