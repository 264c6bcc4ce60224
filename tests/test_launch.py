"""Where `shardwise run` puts the ranks, and what `init_distributed` says when a rank has no GPU.

The plan is a function of (local ranks, visible GPUs), so every kind of machine is tried here by passing the
GPU count; one real launch checks that the ranks get the environment the plan sets. The GPU tier
(tests/gpu/test_main_job.py) runs README command 1 on a real one-GPU machine.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.distributed as dist

import shardwise
from shardwise.cli.commands import _launch_environment, launch
from shardwise.comm.placement import DeviceError, plan_placement, require_gpu, visible_gpus

LAUNCH_VARS = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")


@pytest.fixture
def clean_launch_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The variables a launch sets are unset now and restored after the test."""
    for name in LAUNCH_VARS:
        monkeypatch.setenv(name, "x")  # recorded, so the teardown restores the original (or its absence)
        monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize("nproc, gpus, device", [(2, 0, "cpu"), (1, 1, "cuda"), (2, 2, "cuda"), (2, 4, "cuda")])
def test_ranks_take_the_gpus_when_there_is_one_each_and_nothing_is_said(nproc: int, gpus: int, device: str) -> None:
    placement = plan_placement(nproc, gpus, environ={})
    assert (placement.device, dict(placement.env), placement.note) == (device, {}, None)


def test_more_ranks_than_gpus_run_on_the_cpu_and_say_so_in_one_line() -> None:
    placement = plan_placement(2, 1, environ={})
    assert placement.device == "cpu" and dict(placement.env) == {"CUDA_VISIBLE_DEVICES": ""}
    note = placement.note
    assert note is not None and "\n" not in note
    assert "2 ranks asked for" in note and "1 GPU is visible" in note and "on the CPU with gloo" in note
    assert "`--nproc-per-node 1`" in note and "CUDA_VISIBLE_DEVICES" in note
    # A mask the user set is named, since it is what hides the other GPUs.
    note = plan_placement(8, 4, environ={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}).note
    assert note is not None and "4 GPUs are visible" in note and "`--nproc-per-node 4`" in note
    assert "(now `CUDA_VISIBLE_DEVICES=0,1,2,3`)" in note


def test_require_gpu_names_the_local_rank_the_gpus_and_the_fixes() -> None:
    require_gpu(0, 1, environ={})
    require_gpu(3, 4, environ={})
    with pytest.raises(DeviceError) as one_gpu:
        require_gpu(1, 1, environ={})
    message = str(one_gpu.value)
    assert "LOCAL_RANK 1 needs GPU 1" in message and "sees 1 GPU" in message
    assert "`--nproc-per-node 1`" in message and "`shardwise run`" in message
    with pytest.raises(DeviceError, match="needs a CUDA GPU, but torch .* sees none"):
        require_gpu(0, 0, environ={})


def test_init_distributed_with_nccl_and_no_gpu_for_the_rank_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # One past the GPUs this machine has: 0 on a CPU-only machine (where torch used to fail inside
    # `torch.cuda.set_device` with "Torch not compiled with CUDA enabled"), n on an n-GPU one.
    monkeypatch.setenv("LOCAL_RANK", str(visible_gpus()))
    with pytest.raises(DeviceError, match="init_distributed: "):
        shardwise.init_distributed(backend="nccl")
    assert not dist.is_initialized()


def test_launch_environment_follows_the_plan(clean_launch_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _launch_environment(["--nproc-per-node", "2", "t.py"], gpus=2)
    assert "CUDA_VISIBLE_DEVICES" not in os.environ and capsys.readouterr().err == ""
    _launch_environment(["--nproc-per-node", "2", "t.py"], gpus=1)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert capsys.readouterr().err.startswith("shardwise run: 2 ranks asked for (--nproc-per-node 2) but 1 GPU")
    clean_launch_env.delenv("CUDA_VISIBLE_DEVICES")
    _launch_environment(["--nproc-per-node", "gpu", "t.py"], gpus=1)  # torchrun sizes it to the GPUs
    assert "CUDA_VISIBLE_DEVICES" not in os.environ and capsys.readouterr().err == ""


REPORT = """\
import json, os, sys
from pathlib import Path
import torch, torch.distributed as dist
import shardwise

shardwise.init_distributed()
seen = {"mask": os.environ.get("CUDA_VISIBLE_DEVICES"), "cuda": torch.cuda.is_available(),
        "backend": dist.get_backend()}
Path(sys.argv[1], f"rank{dist.get_rank()}.json").write_text(json.dumps(seen))
dist.destroy_process_group()
"""


def test_two_ranks_on_a_one_gpu_machine_get_no_gpu_and_gloo(
    tmp_path: Path, clean_launch_env: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    assert launch(["--nproc-per-node", "2", str(script), str(tmp_path)], gpus=1) == 0
    assert "but 1 GPU is visible, so the 2 ranks run on the CPU with gloo" in capfd.readouterr().err
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen == {"mask": "", "cuda": False, "backend": "gloo"}
