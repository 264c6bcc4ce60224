"""benchmarks.model: the α-β formulas, ZeRO's memory figures, and the scale table (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


def test_host_work_splits_into_tensors_and_bytes() -> None:
    from benchmarks.calibrate import _WIDE, split_host
    from benchmarks.model import gpt_preset

    shapes = gpt_preset("tiny"), gpt_preset("tiny", **_WIDE)
    assert shapes[0].tensors == shapes[1].tensors and shapes[1].numel > 10 * shapes[0].numel
    per_tensor, per_byte = 20e-6, 0.3e-9
    extra = tuple(per_tensor * s.tensors + per_byte * 4 * s.numel for s in shapes)
    assert split_host(extra, shapes) == pytest.approx((per_tensor, per_byte), rel=1e-9)  # type: ignore[arg-type]
    # a wide shape measured faster than the narrow one (load) gives no negative term
    assert split_host((1e-3, 0.5e-3), shapes) == (pytest.approx(1e-3 / shapes[0].tensors), 0.0)


def test_calibration_passes_merge_figure_by_figure() -> None:
    from benchmarks.calibrate import median_of

    passes = [{"alpha": a, "by_size": {"small": {"flops": f}}, "points": [[16, t], [64, 2 * t]], "date": d}
              for a, f, t, d in ((1.0, 5.0, 0.1, "x"), (9.0, 7.0, 0.3, "y"), (2.0, 6.0, 0.2, "z"))]
    assert median_of(passes) == {"alpha": 2.0, "by_size": {"small": {"flops": 6.0}},
                                 "points": [[16, 0.2], [64, 0.4]], "date": "x"}


def test_stage3_units_and_host_terms_enter_the_step() -> None:
    from benchmarks.collectives import Link
    from benchmarks.model import Cluster, Device, Job, gpt_preset, step_time

    shape = gpt_preset("10m")
    none = Link("none", 0.0, 0.0, "test")

    def total(stage: int, **host: float) -> float:
        device = Device("cpu", 1e11, 1e12, 1e10, "test", **host)
        cluster = Cluster("c", device, 2, none, none, overlaps=False)
        return step_time(Job(shape, param_bytes=4, grad_bytes=4, state_bytes=8), stage, 2, cluster)["total"]

    assert total(2, host_per_byte=1e-9) - total(2) == pytest.approx(4 * shape.numel * 1e-9)
    assert total(2, host_per_unit=1e-3) == total(2)  # units exist at stage 3 only
    assert total(3, host_per_unit=1e-3) - total(3) == pytest.approx(shape.units * 1e-3)


def test_two_rank_host_terms_apply_to_two_ranks_only() -> None:
    """What 2 ranks add (per tensor, per gradient byte, per stage-3 unit) is on top of the one-rank figures,
    and only in predictions for more than one rank."""
    from benchmarks.model import here_cluster

    calibration = {"alpha": 1e-4, "beta": 1e-9, "flops": 1e10, "bandwidth": 1e10,
                   "host_per_tensor_by_stage": {"2": 1e-5}, "host_per_byte_by_stage": {"2": 1e-11},
                   "host_per_tensor_by_stage_2_ranks": {"2": 3e-5}, "host_per_byte_by_stage_2_ranks": {"2": 2e-10},
                   "host_per_unit_2_ranks": 4e-4}
    one, two = (here_cluster(calibration, "10m", n, 2).device for n in (1, 2))
    assert (one.host_per_tensor, one.host_per_byte, one.host_per_unit) == (1e-5, 1e-11, 0.0)
    assert two.host_per_tensor == pytest.approx(4e-5) and two.host_per_byte == pytest.approx(2.1e-10)
    assert two.host_per_unit == 4e-4


def _units_of_engine(threshold: int) -> int:
    import shardwise
    from benchmarks.workload import gpt_module

    gpt = gpt_module()
    model = gpt.GPT(gpt.gpt_config("tiny"))
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold}}
    engine = shardwise.initialize(model, torch.optim.AdamW(model.parameters()), config)
    units = sum(not unit.persistent for unit in engine.strategy.units)
    engine.destroy()
    return units


def test_units_counted_as_the_engine_forms_them() -> None:
    """The model's stage-3 gathers per pass are the engine's own units, with and without persistence."""
    from benchmarks.workload import model_units
    from shardwise.testing import run_distributed

    for threshold in (0, 10_000):
        assert run_distributed(_units_of_engine, world_size=2, args=(threshold,), timeout=120) == \
            [model_units("tiny", threshold)] * 2


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
