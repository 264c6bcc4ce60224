"""ZeRO-Offload on the GPU (issue 38): an offloaded engine trains as the same stage without offload, its bytes
move as theory says, and its checkpoints go to a plain engine, a CPU-only job and back.

Same math: 20 steps of the tiny GPT with accumulation 2 and clipping 0.5, fp32 (TF32 off), every offload
variant of ``_gpu.ZERO_VARIANTS`` against the same stage without offload on the same GPU: within 1e-6 (the
optimizer steps on the host with torch's fused CPU AdamW, on the device with its CUDA kernel: the two round
apart by about 1e-7 a step; a lost gradient or state moves weights by about lr = 1e-3).  The host path's
figures: its gradient and staging buffers are pinned host memory, and per step each element of the state in
host memory goes down once (its fp32 gradient) and up once (its value in the compute dtype).  The CPU suite
runs the same path on the CPU (tests/test_offload_host.py); the CPU cases here check this file's bodies.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import _gpu
import pytest
import torch

import shardwise
from shardwise.zero.offload.shards import FileShardOnDevice, HostShard
from shardwise.zero.store.copies import DeviceCopies
from shardwise.zero.store.plan import host_path_on_cpu

pytestmark = pytest.mark.offload

HERE = Path(__file__).resolve().parent
STEPS = 20
MICRO = 2
OFFLOADS = [case for case in _gpu.zero_cases() if _gpu.offloads(case.values[1])]
#: the cases whose CPU run checks this file's body (tests/test_offload_host.py covers every variant on 2 CPU ranks;
#: all 13 CPU cases here took about 40 s of the suite, these three about 7 s)
_CPU_CHECKED = {(1, "offload-cpu-half"), (2, "offload-nvme-half"), (3, "offload-param-cpu"), (3, "offload-param-nvme")}
PARITY = [pytest.param(*device.values, *case.values, id=f"{case.id}-{device.id}", marks=[*case.marks, *device.marks])
          for case in OFFLOADS for device in _gpu.DEVICES
          if device.values[0] != "cpu" or tuple(case.values) in _CPU_CHECKED]


def _engine(stage: int, variant: str, dtype: str = "fp32", seed: int = 0) -> Any:
    cfg = _gpu.config(stage, dtype, variant)
    cfg.update(gradient_accumulation_steps=MICRO, gradient_clipping=0.5)
    model = _gpu.gpt(seed)
    if "nvme" in variant:
        Path(_gpu.NVME).mkdir(parents=True, exist_ok=True)
    with host_path_on_cpu() if _gpu.offloads(variant) else contextlib.nullcontext():
        return shardwise.initialize(model, _gpu.adamw(model.parameters()), cfg)


def _train(engine: Any, first: int, steps: int, where: torch.device) -> list[float]:
    losses = []
    for micro in range(first * MICRO, (first + steps) * MICRO):
        _, loss = engine(*_gpu.batch(micro, where))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _apart(engine: Any) -> int:
    home = engine.strategy.store.home
    return sum(p.numel for p in home.pieces if p.key is not None and home.apart(p))


@pytest.mark.parametrize("device, stage, variant", PARITY)
def test_offload_trains_as_no_offload_on_the_gpu(device: str, stage: int, variant: str) -> None:
    where = _gpu.one_rank(device)
    plain = _engine(stage, "in-memory")
    plain_losses = _train(plain, 0, STEPS, where)
    want = _gpu.masters(plain)
    plain.destroy()
    engine = _engine(stage, variant)
    cuda = device == "cuda"
    assert all(p.device.type == where.type for p in engine.module.parameters())
    copies = engine.strategy.store.home.copies
    assert isinstance(copies, DeviceCopies) and copies.grads.device.type == "cpu" and copies.grads.is_pinned() == cuda
    apart, dtype_bytes = _apart(engine), 4
    assert apart > 0
    losses = _train(engine, 0, STEPS, where)
    if cuda:
        torch.cuda.synchronize()
    assert copies.moved.down == STEPS * apart * 4, (copies.moved, apart)
    assert copies.moved.up == STEPS * apart * dtype_bytes, (copies.moved, apart)
    if "param" in variant:
        storages = [u.storage for u in engine.strategy.units]
        in_files = variant == "offload-param-nvme"
        assert all(type(s) is (FileShardOnDevice if in_files else HostShard) for s in storages)
        if in_files:  # (`max_in_cpu` 0: no host copy stays; the reads went into pinned memory)
            cache = engine.strategy.shards.cache
            assert cache.pin == cuda and cache.held_numel() == 0 and cache.ahead_hits > 0  # read ahead from the file
            assert engine.strategy.shards.ahead_hits > 0  # and copied up ahead, on the side stream on a GPU
        else:
            assert all(s.home.is_pinned() == cuda for s in storages)
        assert sum(s.held_bytes() for s in storages) < sum(s.nbytes for s in storages), \
            "the shards' device copies go after use"
    got = _gpu.masters(engine)
    diff, name = _gpu.max_diff(got, want)
    assert diff <= 1e-6, f"stage {stage} {variant}: {name} differs from no offload by {diff:.3g}"
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    engine.destroy()
    if cuda:
        torch.cuda.synchronize()
    if "nvme" in variant:
        assert os.listdir(_gpu.NVME) == [], os.listdir(_gpu.NVME)


def _cpu_job(load: Path, save: Path, out: Path, stage: int) -> dict[str, Any]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_gpu.ROOT / "src"), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, str(HERE / "_cpu_job.py"), str(load), str(save), str(out), str(stage),
                           "fp32"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    result: dict[str, Any] = torch.load(out, weights_only=False)
    return result


@pytest.mark.parametrize("device", _gpu.CUDA_ONLY)
@pytest.mark.parametrize("stage, variant", [(1, "offload-cpu"), (3, "offload-param-cpu"), (2, "offload-nvme-half"),
                                            (3, "offload-param-nvme")])
def test_an_offloaded_checkpoint_goes_to_a_plain_engine_a_cpu_job_and_back(device: str, stage: int, variant: str,
                                                                           tmp_path: Path) -> None:
    where = _gpu.one_rank(device)
    offloaded = _gpu.engine(stage, "fp32", variant)
    _gpu.train(offloaded, 0, 2, where)
    offloaded.save_checkpoint(str(tmp_path / "offloaded"), tag="gpu")
    saved = _gpu.masters(offloaded)
    plain = _gpu.engine(stage, "fp32", seed=1)
    assert plain.load_checkpoint(str(tmp_path / "offloaded"))[0] is not None
    assert _gpu.max_diff(_gpu.masters(plain), saved)[0] == 0.0
    cpu = _cpu_job(tmp_path / "offloaded", tmp_path / "cpu", tmp_path / "cpu.pt", stage)
    assert cpu["cuda"] is False and _gpu.max_diff(cpu["loaded"], saved)[0] == 0.0
    _gpu.train(offloaded, 2, 2, where)
    _gpu.train(plain, 2, 2, where)
    for other in (plain, None):
        got = _gpu.masters(plain) if other is plain else cpu["trained"]
        diff, name = _gpu.max_diff(got, _gpu.masters(offloaded))
        assert diff <= 1e-5, f"steps 2-3 after the load differ at {name} by {diff:.3g}"
    back = _gpu.engine(stage, "fp32", variant, seed=2)
    assert back.load_checkpoint(str(tmp_path / "cpu"))[0] is not None
    assert _gpu.max_diff(_gpu.masters(back), cpu["trained"])[0] == 0.0
    _gpu.train(back, 4, 1, where)  # its optimizer state is usable in host memory
    for engine in (offloaded, plain, back):
        engine.destroy()
