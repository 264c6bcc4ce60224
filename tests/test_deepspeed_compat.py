"""`shardwise.deepspeed`: DeepSpeed client scripts run with only their imports changed.

The two client scripts in examples/deepspeed/ (written in the style of DeepSpeedExamples') run on
2 gloo ranks at ZeRO stages 0 and 3 in one launch. Stage 3 must train to the same weights as
stage 0 (itself checked against torch DDP in test_stage0.py): fp32, atol 1e-5.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise.deepspeed as deepspeed
from shardwise.deepspeed.accelerator import CpuAccelerator, get_accelerator
from shardwise.testing import run_distributed

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "deepspeed"


# ------------------------------------------------------------------------ one process


def test_add_config_arguments_takes_local_rank_from_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    # The DeepSpeedExamples pattern: the script declares --local_rank (default -1) first.
    declared = argparse.ArgumentParser()
    declared.add_argument("--local_rank", type=int, default=-1)
    args = deepspeed.add_config_arguments(declared).parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert (args.local_rank, args.deepspeed, args.deepspeed_config) == (1, True, "ds.json")
    assert deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args([]).local_rank == 1
    assert deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args(["--local-rank", "3"]).local_rank == 3
    monkeypatch.delenv("LOCAL_RANK")
    assert deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args([]).local_rank == -1


def test_initialize_rejects_what_it_cannot_honour() -> None:
    args = argparse.Namespace(deepspeed_config="a.json")
    with pytest.raises(ValueError, match="got a config twice"):
        deepspeed.initialize(args=args, model=nn.Linear(2, 2), config={})
    with pytest.raises(ValueError, match="needs a config"):
        deepspeed.initialize(model=nn.Linear(2, 2))
    with pytest.raises(ValueError, match="`mpu=` asks for model parallelism"):
        deepspeed.initialize(model=nn.Linear(2, 2), config={}, mpu=object())
    with pytest.raises(TypeError, match="needs `model=`"):
        deepspeed.initialize(config={})
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="dist_init_required=False"):
            deepspeed.initialize(model=nn.Linear(2, 2), config={}, dist_init_required=False)
    with pytest.raises(ValueError, match="zero_quantized_weights=True"):
        deepspeed.zero.Init(zero_quantized_weights=True)


def test_cpu_accelerator_answers_like_deepspeeds() -> None:
    cpu = CpuAccelerator()
    assert (cpu.device_name(), cpu.device_name(1), cpu.communication_backend_name()) == ("cpu", "cpu", "gloo")
    assert cpu.device(0) == torch.device("cpu") and cpu.is_available() and cpu.is_bf16_supported()
    cpu.set_device(0)
    cpu.synchronize()
    cpu.manual_seed(3)
    first = torch.rand(2)
    cpu.manual_seed_all(3)
    assert torch.equal(first, torch.rand(2))
    assert cpu.memory_allocated() > 0 and cpu.max_memory_allocated() >= cpu.memory_allocated() // 2
    assert torch.bfloat16 in cpu.supported_dtypes() and cpu.on_accelerator(torch.zeros(1))
    if not torch.cuda.is_available():
        assert isinstance(get_accelerator(), CpuAccelerator)


def test_comm_answers_without_a_process_group() -> None:
    assert not dist.is_initialized()  # tests/conftest.py: no test leaves its group behind
    assert (deepspeed.comm.get_rank(), deepspeed.comm.get_world_size(), deepspeed.comm.is_initialized()) == (0, 1, False)
    assert deepspeed.comm.barrier() is None


# ------------------------------------------------------------------------ two ranks


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_ds_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_examples(out: str) -> dict[str, Any]:
    """Both client scripts at stages 0 and 3 on this rank, plus what the compat module saw."""
    results: dict[str, Any] = {}
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("shardwise")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    for script, flag in (("train_classifier", "--save-dir"), ("train_lm", "--output-dir")):
        module = _load(script)
        prefix = "classifier" if script == "train_classifier" else "lm"
        for stage in (0, 3):
            config = str(EXAMPLES / f"{prefix}_stage{stage}.json")
            results[f"{prefix}{stage}"] = module.main(
                ["--deepspeed", "--deepspeed_config", config, flag, f"{out}/{prefix}{stage}"])
    results["comm"] = _comm_checks()
    results["loader"] = _loader_shares()
    results["config_lines"] = [line for line in lines if line.startswith("config: ")]
    return results


def _comm_checks() -> dict[str, Any]:
    comm = deepspeed.comm
    value = torch.tensor([float(comm.get_rank() + 1)])
    comm.all_reduce(value, prof=True, log_name="sum")  # DeepSpeed's profiling keywords are accepted
    gathered = [torch.zeros(1) for _ in range(comm.get_world_size())]
    comm.all_gather(gathered, torch.tensor([float(comm.get_rank())]))
    comm.barrier()
    return {"sum": value.item(), "gathered": [t.item() for t in gathered], "local_rank": comm.get_local_rank()}


def _loader_shares() -> dict[str, Any]:
    """The training DataLoader: micro-batches of the config's size, each rank its own share."""
    dataset = torch.utils.data.TensorDataset(torch.arange(20.0).unsqueeze(1))
    config = {"train_micro_batch_size_per_gpu": 3, "dataloader_drop_last": True,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    _, optimizer, loader, scheduler = deepspeed.initialize(model=nn.Linear(1, 1), config=config,
                                                           training_data=dataset)
    seen = [int(x) for (batch,) in loader for x in batch.flatten().tolist()]
    sizes = [len(batch) for (batch,) in loader]
    return {"seen": seen, "sizes": sizes, "optimizer": type(optimizer).__name__, "scheduler": scheduler}


def test_deepspeed_client_scripts_on_two_ranks(tmp_path: Path) -> None:
    ranks = run_distributed(_run_examples, world_size=2, args=(str(tmp_path),), timeout=300)
    for rank, result in enumerate(ranks):
        for run in ("classifier0", "classifier3"):
            got = result[run]
            assert got["distributed"] and got["local_rank"] == rank  # torchrun's LOCAL_RANK reached args
            assert got["client_state"] == {"epoch": 3, "note": "saved by train_classifier"}
            losses = got["losses"]
            assert len(losses) == 3 * 256 // (2 * 4)  # the loader split 256 samples over 2 ranks, micro-batch 4
            assert sum(losses[-8:]) < 0.5 * sum(losses[:8])
        for run in ("lm0", "lm3"):
            got = result[run]
            assert got["local_rank"] == rank and got["client_state"] == {"step": 6}
            assert (got["scheduler"], got["optimizer"]) == ("LambdaLR", "AdamW")  # the all-auto scheduler gave way
            assert got["losses"][-1] < got["losses"][0]
            assert got["config"]["optimizer"]["params"] == {"lr": 0.003}  # betas/eps/weight_decay: torch's defaults
            assert got["config"]["zero_optimization"]["reduce_bucket_size"] == 32 * 32  # hidden_size² (auto)
        assert result["comm"] == {"sum": 3.0, "gathered": [0.0, 1.0], "local_rank": rank}
        assert result["loader"]["sizes"] == [3, 3, 3] and result["loader"]["optimizer"] == "ZeroOptimizer"
    assert sorted(ranks[0]["loader"]["seen"] + ranks[1]["loader"]["seen"]) == sorted(
        set(ranks[0]["loader"]["seen"]) | set(ranks[1]["loader"]["seen"]))  # disjoint shares
    # Stage 3 trains to the weights stage 0 does (fp32; rank 0 holds the full state dict).
    for prefix in ("classifier", "lm"):
        zero, three = ranks[0][f"{prefix}0"]["weights"], ranks[0][f"{prefix}3"]["weights"]
        assert zero.keys() == three.keys()
        for name in zero:
            torch.testing.assert_close(three[name], zero[name], atol=1e-5, rtol=0, msg=f"{prefix} {name}")
    assert (tmp_path / "lm3" / "model.safetensors").is_file()
    # Info lines about the configs: on rank 0 only, once per line per config.
    assert ranks[1]["config_lines"] == []
    logged = ranks[0]["config_lines"]
    assert "config: `zero_optimization.sub_group_size` changes nothing here: it tiles the optimizer step of " \
           "`offload_optimizer` to `nvme`, or to `cpu` on a job on an accelerator, which is off" in logged
    assert "config: `scheduler`: every param is `auto`, so the lr_scheduler passed to initialize is used" in logged
    assert logged.count("config: `tensorboard` leaves the TensorBoard monitor off, as in shardwise: ignored") == 2
