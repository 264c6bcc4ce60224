"""What a Trainer run shows and writes besides checkpoints: the bar on a real pty (tokens/s every step, no engine
lines breaking it), plain lines on a 0-column pty, the CSV/W&B/MLflow loggers (fakes stand in for the
packages), `shardwise --version`, and the example GPT's KV cache."""

from __future__ import annotations

import csv
import fcntl
import os
import pty
import struct
import sys
import termios
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _trainer_common import config
from torch import nn

from shardwise.cli.commands import main as cli_main
from shardwise.testing import run_distributed
from shardwise.trainer import CSVLogger, MLflowCallback, Trainer, WandbCallback
from shardwise.trainer.progress import Bar, Lines, make_progress

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _pty(columns: int) -> tuple[int, Any]:
    """A pty of ``columns`` columns: its master fd, and its slave end as a text stream."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    return master, os.fdopen(slave, "w")


def _drain(master: int) -> str:
    os.set_blocking(master, False)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except (BlockingIOError, OSError):
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def test_zero_column_pty_gets_lines_and_a_real_pty_a_bar() -> None:
    master, stream = _pty(0)
    assert isinstance(make_progress(0, True, stream), Lines)  # a bar on 0 columns would draw nothing
    os.close(master)
    master, stream = _pty(100)
    assert isinstance(make_progress(0, True, stream), Bar)
    os.close(master)


class Bytes(nn.Module):
    """Token ids in, a loss out: enough for the bar to count tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.out = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.out(self.emb(ids[:, :-1])).flatten(0, 1), ids[:, 1:].flatten())


def _bar_on_pty() -> str:
    master, stream = _pty(120)
    sys.stdout = stream  # the bar and the engine's log handler both find the pty here
    data = [torch.randint(0, 16, (12,), generator=torch.Generator().manual_seed(i)) for i in range(64)]
    torch.manual_seed(0)
    Trainer(Bytes(), data, config=config(0, steps_per_print=2), max_steps=12,
            log_every=100).fit()
    stream.flush()
    return _drain(master)


def test_bar_on_a_pty_shows_tokens_per_second_every_step_and_no_engine_lines() -> None:
    out = run_distributed(_bar_on_pty, 1, timeout=120)[0]
    # the bar's rate comes from every step, not from logged steps (none before the end here)
    bar = [part for part in out.split("\r") if "12/12" in part]
    assert bar and "speed=" in bar[-1] and "tokens/s" in bar[-1], out
    # steps_per_print=2 would print the engine's `[shardwise] step N: lr=...` line 6 times into the bar
    assert "step 2:" not in out and "lr=[" not in out, out


class _FakeTrainer:
    rank = 0

    class engine:  # noqa: N801 - stands in for trainer.engine
        class config:  # noqa: N801
            @staticmethod
            def model_dump() -> dict[str, Any]:
                return {"zero_optimization": {"stage": 2}}


def test_csv_logger_widens_its_header_when_eval_columns_appear(tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    logger = CSVLogger(str(path))
    trainer: Any = _FakeTrainer()
    logger.on_train_start(trainer)
    logger.on_log(trainer, {"step": 10, "loss": 2.0, "lr": 1e-3, "memory": [{"params": 1}]})
    logger.on_log(trainer, {"step": 20, "loss": 1.5, "lr": 1e-3})
    logger.on_log(trainer, {"step": 20, "eval_loss": 1.7})
    rows = list(csv.DictReader(path.open()))
    assert list(rows[0]) == ["step", "loss", "lr", "eval_loss"]
    assert [(r["step"], r["loss"], r["eval_loss"]) for r in rows] == [("10", "2.0", ""), ("20", "1.5", ""),
                                                                     ("20", "", "1.7")]


def test_wandb_and_mlflow_callbacks_log_records_through_the_installed_package(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any]] = []

    class Run:
        def log(self, values: dict[str, float], step: int) -> None:
            calls.append(("wandb.log", (values, step)))

        def finish(self) -> None:
            calls.append(("wandb.finish", None))

    wandb = types.ModuleType("wandb")
    wandb.init = lambda **kwargs: calls.append(("wandb.init", kwargs)) or Run()  # type: ignore[attr-defined]
    mlflow = types.ModuleType("mlflow")
    mlflow.active_run = lambda: None  # type: ignore[attr-defined]
    mlflow.start_run = lambda run_name=None: calls.append(("mlflow.start_run", run_name))  # type: ignore[attr-defined]
    mlflow.log_metrics = lambda values, step: calls.append(("mlflow.log_metrics", (values, step)))  # type: ignore[attr-defined]
    mlflow.end_run = lambda: calls.append(("mlflow.end_run", None))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    trainer: Any = _FakeTrainer()
    for callback in (WandbCallback(project="p"), MLflowCallback(run_name="r")):
        callback.on_train_start(trainer)
        callback.on_log(trainer, {"step": 10, "epoch": 0, "loss": 2.0, "grad_norm": None, "memory": [{}]})
        callback.on_train_end(trainer, None)  # type: ignore[arg-type]
    assert calls == [
        ("wandb.init", {"project": "p", "config": {"zero_optimization": {"stage": 2}}}),
        ("wandb.log", ({"epoch": 0.0, "loss": 2.0}, 10)),
        ("wandb.finish", None),
        ("mlflow.start_run", "r"),
        ("mlflow.log_metrics", ({"epoch": 0.0, "loss": 2.0}, 10)),
        ("mlflow.end_run", None),
    ]
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: an ImportError that says how to install it
    with pytest.raises(ImportError, match="pip install wandb"):
        WandbCallback().on_train_start(trainer)


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == "shardwise 0.1.0"


def test_example_gpt_kv_cache_generates_what_full_recompute_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from gpt import GPT, gpt_config

    torch.manual_seed(0)
    model = GPT(gpt_config("tiny")).eval()  # block_size 64
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
    assert torch.equal(model.generate(prompt, 50), model.generate(prompt, 50, use_cache=False))
    torch.manual_seed(3)
    sampled = model.generate(prompt, 50, temperature=1.0)
    torch.manual_seed(3)
    assert torch.equal(sampled, model.generate(prompt, 50, temperature=1.0, use_cache=False))
    # Past block_size the cache restarts from the last half of the text; it keeps going.
    assert model.generate(prompt, 100).shape == (2, 105)
