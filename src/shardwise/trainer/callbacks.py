"""Callbacks: objects with any of ``on_train_start``, ``on_step_end``, ``on_log``, ``on_eval_end``, ``on_save``,
``on_train_end`` (docs/trainer.md).

Every hook runs on every rank; a save or stop a callback requests is decided by all ranks together at the end of the
step. The loggers write on rank 0 only, and import TensorBoard, W&B and MLflow when training starts: shardwise does not
depend on them.
"""

from __future__ import annotations

import csv
import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from .evaluation import Watch

if TYPE_CHECKING:
    from .loop import FitSummary, Trainer

__all__ = ["CSVLogger", "Callback", "EarlyStopping", "MLflowCallback", "TensorBoardCallback", "WandbCallback", "scalars"]


class Callback:
    """A base class with every hook doing nothing; override the ones you need."""

    def on_train_start(self, trainer: "Trainer") -> None:
        """Before the first step of ``fit()`` (after a resume has loaded its checkpoint)."""

    def on_step_end(self, trainer: "Trainer", metrics: dict[str, Any]) -> None:
        """After each optimizer step; ``metrics`` has ``step``, ``epoch``, ``loss`` (mean over ranks), ``lr``."""

    def on_log(self, trainer: "Trainer", record: dict[str, Any]) -> None:
        """Each record the metrics file gets (every ``log_every`` steps, and each evaluation's), on every rank."""

    def on_eval_end(self, trainer: "Trainer", metrics: dict[str, Any]) -> None:
        """After an evaluation; ``metrics`` has ``step``, ``eval_loss`` (over the whole eval set) and, with
        ``compute_metrics``, its results as ``eval_<name>``."""

    def on_save(self, trainer: "Trainer", path: str) -> None:
        """After a checkpoint was written (on every rank, once it is complete)."""

    def on_train_end(self, trainer: "Trainer", summary: "FitSummary") -> None:
        """When ``fit()`` ends, with what it returns."""


class TensorBoardCallback(Callback):
    """Writes the step and eval metrics as TensorBoard scalars on rank 0 (``pip install 'shardwise[tensorboard]'``).

    ``writer`` may be any object with ``add_scalar(tag, value, step)`` (and optionally ``flush``/``close``);
    by default a ``torch.utils.tensorboard.SummaryWriter(log_dir)`` is made on rank 0 when training starts.
    """

    SCALARS = ("loss", "lr", "grad_norm", "loss_scale", "tokens_per_s", "samples_per_s", "eval_loss")

    def __init__(self, log_dir: Optional[str] = None, writer: Any = None) -> None:
        self.log_dir, self.writer = log_dir, writer

    def on_train_start(self, trainer: "Trainer") -> None:
        if self.writer is not None or trainer.rank != 0:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter  # here: heavy, optional, only for this callback
        except ImportError as error:
            raise ImportError(
                f"`TensorBoardCallback` needs the `tensorboard` package ({error}); install it with "
                "`pip install 'shardwise[tensorboard]'`, or pass `writer=` an object with `add_scalar`") from error
        self.writer = SummaryWriter(log_dir=self.log_dir)

    def on_step_end(self, trainer: "Trainer", metrics: dict[str, Any]) -> None:
        if self.writer is None or trainer.rank != 0:
            return
        for key in self.SCALARS:
            value = metrics.get(key)
            if isinstance(value, (int, float)):
                self.writer.add_scalar(f"train/{key}" if key != "eval_loss" else "eval/loss", value, metrics["step"])

    on_eval_end = on_step_end

    def on_train_end(self, trainer: "Trainer", summary: "FitSummary") -> None:
        close = getattr(self.writer, "close", None)
        if callable(close):
            close()


class EarlyStopping(Callback):
    """Stops training once ``patience`` evaluations in a row did not improve ``metric`` by more than ``min_delta``."""

    def __init__(self, metric: str = "eval_loss", patience: int = 3, greater_is_better: bool = False,
                 min_delta: float = 0.0) -> None:
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"`EarlyStopping(patience={patience!r})`: expected an integer >= 1")
        self.watch = Watch(metric, greater_is_better, min_delta)
        self.patience, self.waited = patience, 0

    def on_eval_end(self, trainer: "Trainer", metrics: dict[str, Any]) -> None:
        if self.watch.update(metrics):
            self.waited = 0
            return
        self.waited += 1
        if self.waited >= self.patience:
            trainer.request_stop(
                f"early stopping: `{self.watch.name}` has not improved on {self.watch.best:.6g} (step "
                f"{self.watch.best_step}) for {self.waited} evaluation(s)")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numbers (``step`` left out; None, lists and dicts dropped)."""
    return {key: float(value) for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}


def _import(module: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"this callback needs the `{module}` package ({error}); install it with `pip install {extra}`, "
            "or drop the callback") from error


class CSVLogger(Callback):
    """Writes the records to ``path`` as CSV on rank 0; a column that first appears later rewrites the header."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.rows: list[dict[str, Any]] = []
        self.columns: list[str] = []

    def on_train_start(self, trainer: "Trainer") -> None:
        self.rows, self.columns = [], []

    def on_log(self, trainer: "Trainer", record: dict[str, Any]) -> None:
        if trainer.rank != 0:
            return
        row = {"step": record.get("step"), **scalars(record)}
        new = [key for key in row if key not in self.columns]
        self.rows.append(row)
        self.columns += new
        if new or not self.path.is_file():  # a new column: every row again, under the wider header
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "w", newline="", encoding="utf-8") as handle:
                writer = csv.DictWriter(handle, self.columns)
                writer.writeheader()
                writer.writerows(self.rows)
        else:
            with open(self.path, "a", newline="", encoding="utf-8") as handle:
                csv.DictWriter(handle, self.columns).writerow(row)


class WandbCallback(Callback):
    """Logs the records to Weights & Biases on rank 0 (``pip install wandb``); ``init`` goes to ``wandb.init``."""

    def __init__(self, **init: Any) -> None:
        self.init = init
        self.run: Any = None

    def on_train_start(self, trainer: "Trainer") -> None:
        if trainer.rank == 0 and self.run is None:
            wandb = _import("wandb", "wandb")
            config = {"config": trainer.engine.config.model_dump()} if "config" not in self.init else {}
            self.run = wandb.init(**self.init, **config)

    def on_log(self, trainer: "Trainer", record: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.log(scalars(record), step=int(record["step"]))

    def on_train_end(self, trainer: "Trainer", summary: "FitSummary") -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class MLflowCallback(Callback):
    """Logs the records to MLflow on rank 0 (``pip install mlflow``), in a run it starts unless one is active."""

    def __init__(self, experiment: Optional[str] = None, run_name: Optional[str] = None) -> None:
        self.experiment, self.run_name = experiment, run_name
        self.mlflow: Any = None
        self.started = False

    def on_train_start(self, trainer: "Trainer") -> None:
        if trainer.rank != 0 or self.mlflow is not None:
            return
        self.mlflow = _import("mlflow", "mlflow")
        if self.experiment is not None:
            self.mlflow.set_experiment(self.experiment)
        if self.mlflow.active_run() is None:
            self.mlflow.start_run(run_name=self.run_name)
            self.started = True

    def on_log(self, trainer: "Trainer", record: dict[str, Any]) -> None:
        if self.mlflow is not None:
            self.mlflow.log_metrics(scalars(record), step=int(record["step"]))

    def on_train_end(self, trainer: "Trainer", summary: "FitSummary") -> None:
        if self.mlflow is not None and self.started:
            self.mlflow.end_run()
        self.mlflow, self.started = None, False
