"""Checkpoints on the device: a round trip is exact, and a GPU checkpoint continues in a CPU-only job and back.

Round trip: save after 2 steps, load into an engine built from other initial
weights, and both engines take the same 2 further steps: masters and losses
equal to the bit.  Across devices (fp32, TF32 off): the CPU job
(``_cpu_job.py`` with ``CUDA_VISIBLE_DEVICES=""``, so it sees no GPU at all, as
on a CPU-only machine) loads the masters to the bit, continues 2 steps, and its
weights agree with the GPU engine's own 2 further steps within 1e-5 (the two
devices' kernels round differently; a lost optimizer state would move weights
by ~lr = 1e-3); its checkpoint loads back on the device to the bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import _gpu
import pytest
import torch

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("device", _gpu.DEVICES)
@pytest.mark.parametrize("stage, variant", _gpu.zero_cases())
def test_checkpoint_round_trip_is_exact(device: str, stage: int, variant: str, tmp_path: Path) -> None:
    where = _gpu.one_rank(device)
    first = _gpu.engine(stage, "bf16", variant)
    _gpu.train(first, 0, 2, where)
    first.save_checkpoint(str(tmp_path), tag="two")
    second = _gpu.engine(stage, "bf16", variant, seed=1)
    path, _ = second.load_checkpoint(str(tmp_path))
    assert path is not None and path.endswith("two")
    assert _gpu.max_diff(_gpu.masters(second), _gpu.masters(first))[0] == 0.0
    assert _gpu.train(second, 2, 2, where) == _gpu.train(first, 2, 2, where)
    assert _gpu.max_diff(_gpu.masters(second), _gpu.masters(first))[0] == 0.0
    for engine in (first, second):
        engine.destroy()


def _cpu_job(load: Path, save: Path, out: Path, stage: int) -> dict[str, object]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_gpu.ROOT / "src"), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, str(HERE / "_cpu_job.py"), str(load), str(save), str(out), str(stage),
                           "fp32"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    result: dict[str, object] = torch.load(out, weights_only=False)
    return result


# GPU only: on the CPU it is a CPU-to-CPU trip the regular suite has, at 13 s a case here (a subprocess)
@pytest.mark.parametrize("device", _gpu.CUDA_ONLY)
@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_continues_in_a_cpu_only_job_and_back(device: str, stage: int, tmp_path: Path) -> None:
    where = _gpu.one_rank(device)
    engine = _gpu.engine(stage, "fp32")
    _gpu.train(engine, 0, 2, where)
    engine.save_checkpoint(str(tmp_path / "device"), tag="device")
    saved = _gpu.masters(engine)
    cpu = _cpu_job(tmp_path / "device", tmp_path / "cpu", tmp_path / "cpu.pt", stage)
    assert cpu["cuda"] is False and str(cpu["path"]).endswith("device")
    assert _gpu.max_diff(cpu["loaded"], saved)[0] == 0.0  # type: ignore[arg-type]
    _gpu.train(engine, 2, 2, where)  # the device's own continuation
    diff, name = _gpu.max_diff(cpu["trained"], _gpu.masters(engine))  # type: ignore[arg-type]
    assert diff <= 1e-5, f"the CPU job's steps 2-3 differ from the device's at {name} by {diff:.3g}"
    back = _gpu.engine(stage, "fp32", seed=2)
    assert back.load_checkpoint(str(tmp_path / "cpu"))[0] is not None
    assert all(p.device.type == where.type for p in back.module.parameters())
    assert _gpu.max_diff(_gpu.masters(back), cpu["trained"])[0] == 0.0  # type: ignore[arg-type]
    _gpu.train(back, 4, 1, where)  # its optimizer state is usable where it landed
    for e in (engine, back):
        e.destroy()
