"""A DeepSpeed client script on the device: examples/deepspeed/train_lm.py with only its imports changed.

It trains at stage 0 and at stage 3 (its config offloads the optimizer to
pinned CPU memory), saves, loads and writes a 16-bit model.  Stage 3 must
train to stage 0's weights: within 1e-4 on the GPU, where stage 0 steps on the
GPU and the offloaded stage 3 on the CPU (their AdamW kernels round
differently), 1e-5 where both step on the CPU.  The CPU case is
tests/test_deepspeed_compat.py's (2 gloo ranks).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import _gpu
import pytest

from shardwise.deepspeed.accelerator import get_accelerator

EXAMPLES = _gpu.ROOT / "examples" / "deepspeed"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_gpu_ds_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("device", _gpu.CUDA_ONLY)
def test_deepspeed_client_trains_on_the_device(device: str, tmp_path: Path) -> None:
    _gpu.one_rank(device)
    assert get_accelerator().device_name(0) == ("cuda:0" if device == "cuda" else "cpu")
    lm = _load("train_lm")
    runs = {stage: lm.main(["--deepspeed", "--deepspeed_config", str(EXAMPLES / f"lm_stage{stage}.json"),
                            "--output-dir", str(tmp_path / f"lm{stage}")]) for stage in (0, 3)}
    for got in runs.values():
        assert got["client_state"] == {"step": 6} and got["losses"][-1] < got["losses"][0]
    zero, three = runs[0]["weights"], runs[3]["weights"]
    diff, name = _gpu.max_diff({k: v.float().cpu() for k, v in three.items()},
                               {k: v.float().cpu() for k, v in zero.items()})
    assert diff <= (1e-4 if device == "cuda" else 1e-5), f"stage 3 differs from stage 0 at {name} by {diff:.3g}"
    assert (tmp_path / "lm3" / "model.safetensors").is_file()
