"""Messages and docs true for the user's own program (issue 35), met porting a DeepSpeed script and
fine-tuning with the Trainer.

Each case failed before issue 35: `engine.device` was an AttributeError; an engine built without a
`scheduler` loading a checkpoint saved with one was told the checkpoint was "damaged or crafted"; a
Trainer resolving `total_num_steps: auto` said `reduce_bucket_size`, `reduce_scatter` and
`sub_group_size` "change nothing here" though the user never wrote them; the Trainer's "nothing to
train" line named the example's `--steps` / `--fresh` in the user's own script and its metrics file was
rewritten (non-atomically) by a run that trained nothing; the example's closing line left out
`metrics.png` and `model.json` on such a run, and rewrote `model.json`; `shardwise config validate`
showed the plain dialect's values only; docs/from-deepspeed.md listed NVMe offload at stage 3 as not
implemented.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from _log_capture import logged
from _trainer_common import TinyNet, dataset
from torch import nn
from torch.utils.data import TensorDataset

import shardwise
import shardwise.deepspeed as deepspeed
from shardwise.checkpoint import CheckpointError
from shardwise.cli.commands import main as cli_main
from shardwise.config import Config, ConfigError
from shardwise.testing import distributed_test

ROOT = Path(__file__).resolve().parent.parent
SGD = {"type": "SGD", "params": {"lr": 0.1}}


# ------------------------------------------------------------ DeepSpeed's engine attributes


@distributed_test(world_size=2, timeout=120)
def test_a_ported_script_reads_the_engine_attributes_deepspeed_has() -> None:
    model = nn.Linear(4, 2)
    engine, _, loader, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), training_data=TensorDataset(torch.randn(8, 4)),
        config={"train_micro_batch_size_per_gpu": 2, "steps_per_print": 7, "optimizer": SGD})
    assert engine.device == torch.device("cpu") and isinstance(engine.device, torch.device)
    batch = next(iter(loader))[0].to(engine.device)  # what DeepSpeed scripts write
    engine.backward(engine(batch).sum())
    engine.step()
    assert (engine.dp_world_size, engine.global_steps, engine.global_samples) == (2, 1, 4)
    assert engine.steps_per_print() == 7 and engine.training_dataloader is loader
    with pytest.raises(AttributeError, match="neither `Engine` nor the wrapped module `Linear` has an attribute"):
        engine.no_such_attribute  # noqa: B018
    engine.destroy()


# ------------------------------------------------------------ a config mismatch on load


def _engine(scheduler: bool) -> Any:
    torch.manual_seed(0)
    cfg: dict[str, Any] = {"optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    if scheduler:
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}
    return shardwise.initialize(nn.Linear(4, 2), config=cfg)


@distributed_test(world_size=1, timeout=120)
def test_loading_without_the_scheduler_section_is_named_a_config_mismatch(tmp_path: Path) -> None:
    saver = _engine(scheduler=True)
    saver.backward(saver(torch.ones(3, 4)).sum())
    saver.step()
    saver.save_checkpoint(tmp_path)
    loader = _engine(scheduler=False)
    with pytest.raises(CheckpointError) as info:
        loader.load_checkpoint(tmp_path)
    message = str(info.value)
    assert "the configs differ" in message and "`load_lr_scheduler_states=False`" in message, message
    assert "`scheduler` section" in message and "damaged or crafted" not in message, message
    path, _ = loader.load_checkpoint(tmp_path, load_lr_scheduler_states=False)  # the fix the message names
    assert path is not None and loader.global_steps == 1
    assert torch.equal(loader.module.weight, saver.module.weight)


# ------------------------------------------------------------ the Trainer


def _log_lines(action: Callable[[], Any]) -> list[str]:
    with logged() as lines:
        action()
    return lines


@distributed_test(world_size=1, timeout=120)
def test_info_lines_name_only_keys_the_user_wrote() -> None:
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 1, "total_num_steps": "auto"}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}

    def fit() -> None:
        trainer = shardwise.Trainer(TinyNet(dropout=0.0), dataset(8), config=config, max_steps=2, progress=False)
        trainer.fit()
        trainer.engine.destroy()

    lines = _log_lines(fit)
    assert any("total_num_steps: auto` became 2" in line for line in lines), lines
    assert not [line for line in lines if "changes nothing here" in line], lines
    # a key the user did write still gets its line
    config["zero_optimization"]["sub_group_size"] = 1000  # type: ignore[index]
    assert any("`zero_optimization.sub_group_size` changes nothing here" in line for line in _log_lines(fit))


@distributed_test(world_size=1, timeout=120)
def test_a_finished_run_says_what_to_raise_in_the_users_terms_and_writes_nothing(tmp_path: Path) -> None:
    def trainer() -> Any:
        return shardwise.Trainer(TinyNet(dropout=0.0), dataset(8), config={"optimizer": SGD,
                                 "train_micro_batch_size_per_gpu": 2}, max_steps=2, progress=False,
                                 checkpoint_dir=str(tmp_path / "ckpt"), save_every=2,
                                 metrics_file=str(tmp_path / "metrics.jsonl"), log_every=1)

    first = trainer()
    first.fit()
    first.engine.destroy()
    metrics = tmp_path / "metrics.jsonl"
    before = os.stat(metrics)
    shown = io.StringIO()
    with redirect_stdout(shown):
        again = trainer()
        summary = again.fit()
    again.engine.destroy()
    assert summary.trained_steps == 0 and "nothing to train" in shown.getvalue(), shown.getvalue()
    assert "max_steps=2" in shown.getvalue() and "--steps" not in shown.getvalue() and "--fresh" not in shown.getvalue()
    after = os.stat(metrics)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not rewritten


def test_the_example_rerun_at_its_end_touches_no_file_and_lists_them_all(tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_text((ROOT / "src" / "shardwise" / "engine" / "engine.py").read_text()[:20000])
    run = tmp_path / "run"
    command = [sys.executable, "examples/train_gpt.py", "--size", "tiny", "--steps", "2", "--run-dir", str(run),
               "--data", str(text), "--eval-every", "2", "--save-every", "2", "--sample-tokens", "0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    first = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    files = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in run.rglob("*")}
    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in run.rglob("*")} == files  # README: as it was
    closing = again.stdout.strip().splitlines()[-1]
    assert closing.startswith(f"run directory {run}: checkpoints/, metrics.jsonl, metrics.png, model.json;"), closing
    assert "pass a larger --steps than 2 to train further, or --fresh to start over" in again.stdout, again.stdout


# ------------------------------------------------------------ `shardwise config validate --dialect`


def test_config_validate_shows_what_the_deepspeed_dialect_applies(tmp_path: Path) -> None:
    file = tmp_path / "ds.json"
    file.write_text('{"optimizer": {"type": "AdamW", "params": {"lr": 0.001}}, "train_micro_batch_size_per_gpu": 2}')
    results = {}
    for dialect in ("shardwise", "deepspeed"):
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            assert cli_main(["config", "validate", str(file), "--dialect", dialect]) == 0
        results[dialect] = (out.getvalue(), err.getvalue())
    plain, ported = results["shardwise"][0], results["deepspeed"][0]
    assert '"gradient_clipping": 0.0' in plain and '"gradient_clipping": 1.0' in ported, ported
    assert '"weight_decay": 0.0' in ported and '"save_rng_state": false' in ported, ported
    assert "deepspeed dialect: `gradient_clipping` is not set, so gradients are clipped to norm 1.0" in \
        results["deepspeed"][1]


# ------------------------------------------------------------ docs that say "not implemented"


def _refused(action: Callable[[], Any]) -> bool:
    try:
        action()
    except (ConfigError, ValueError, TypeError, RuntimeError):
        return True
    return False


def _config(data: dict[str, Any], device: str = "cpu") -> Callable[[], Any]:
    return lambda: Config.load(data).resolve(device=device)


def _nvme_stage3(root: Path) -> Callable[[], Any]:
    folder = str(root / "nvme")
    return _config({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": folder},
                                          "offload_param": {"device": "nvme", "nvme_path": folder}}})


#: each item docs/from-deepspeed.md may list as not implemented (the start of the item) -> what turns it on
NOT_IMPLEMENTED: dict[str, Callable[[Path], Callable[[], Any]]] = {
    "ZeRO-Offload on a GPU": lambda _: _config({"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "cpu"}}}, device="cuda"),
    "NVMe offload at stage 3": _nvme_stage3,
    "ZeRO++": lambda _: _config({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}),
    "MiCS": lambda _: _config({"zero_optimization": {"stage": 3, "mics_shard_size": 2}}),
    "model, tensor and sequence parallelism": lambda _: lambda: deepspeed.initialize(
        model=nn.Linear(2, 2), config={}, mpu=object()),
    "1-bit optimizers": lambda _: _config({"optimizer": {"type": "OneBitAdam"}}),
    "LAMB": lambda _: _config({"optimizer": {"type": "Lamb"}}),
    "DeepSpeed's activation-checkpointing API": lambda _: _config({"activation_checkpointing": {
        "partition_activations": True}}),
    "the monitors": lambda _: _config({"wandb": {"enabled": True}}),
    "the FLOPs profiler": lambda _: _config({"flops_profiler": {"enabled": True}}),
    "the autotuner": lambda _: _config({"autotuning": {"enabled": True}}),
}


def _not_implemented_items(doc: str) -> list[str]:
    """The items of the "**Not implemented:**" bullet, split at its semicolons."""
    bullet = doc.split("* **Not implemented:**", 1)[1].split("\n* ", 1)[0]
    sentence = " ".join(bullet.split()).split(". ", 1)[0]
    return [item.strip().removeprefix("and ").strip() for item in re.split(r";|, and ", sentence) if item.strip()]


def test_every_item_the_docs_call_not_implemented_is_refused_by_the_code(tmp_path: Path) -> None:
    items = _not_implemented_items((ROOT / "docs" / "from-deepspeed.md").read_text())
    assert len(items) >= 10, items
    problems = []
    for item in items:
        key = next((k for k in NOT_IMPLEMENTED if item.startswith(k)), None)
        if key is None:
            problems.append(f"{item!r}: no probe here turns it on; add one to NOT_IMPLEMENTED")
        elif not _refused(NOT_IMPLEMENTED[key](tmp_path)):
            problems.append(f"{item!r}: the docs call it not implemented, but it works")
    assert not problems, problems


def test_the_nvme_offload_the_docs_describe_works() -> None:
    # (the negative of one probe above, so that the list cannot pass by refusing everything)
    assert not _refused(_nvme_stage3(Path("/tmp/shardwise-doc-probe")))


def test_async_save_is_refused_as_docs_checkpoints_says() -> None:
    assert "`async_save: true` is refused" in (ROOT / "docs" / "checkpoints.md").read_text()
    assert _refused(_config({"checkpoint": {"async_save": True}}))
