"""Logger callbacks besides the JSONL metrics file: CSV, Weights & Biases, MLflow.

Each writes on rank 0 only, from the ``on_log`` hook, so it sees exactly the
records the metrics file gets (every ``log_every`` steps, and every
evaluation).  W&B and MLflow are imported when training starts, not before:
shardwise does not depend on them, and an error says how to install them.
The per-rank ``memory`` breakdown stays in the JSONL file; these get scalars.
"""

from __future__ import annotations

import csv
import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from .callbacks import Callback

if TYPE_CHECKING:
    from .loop import FitSummary, Trainer

__all__ = ["CSVLogger", "MLflowCallback", "WandbCallback", "scalars"]


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
            "or drop the callback"
        ) from error


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
        if new or not self.path.is_file():
            self._rewrite()  # a new column: every row again, under the wider header
        else:
            with open(self.path, "a", newline="", encoding="utf-8") as handle:
                csv.DictWriter(handle, self.columns).writerow(row)

    def _rewrite(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, self.columns)
            writer.writeheader()
            writer.writerows(self.rows)


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
