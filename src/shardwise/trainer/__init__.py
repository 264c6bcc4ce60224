"""The training loop on top of the engine: :class:`Trainer` (see ``docs/trainer.md``).

``shardwise.Trainer(engine, train_data, max_steps=...).fit()`` batches and shards the data, runs the steps,
evaluates, logs, shows progress, and saves collective checkpoints it can resume from exactly.
"""

from __future__ import annotations

from .batch import BatchError
from .callbacks import Callback, CSVLogger, EarlyStopping, MLflowCallback, TensorBoardCallback, WandbCallback
from .checkpoints import ResumeError
from .loop import FitSummary, StepResult, Trainer
from .metrics import plot_metrics, read_metrics

__all__ = ["BatchError", "CSVLogger", "Callback", "EarlyStopping", "FitSummary", "MLflowCallback", "ResumeError",
           "StepResult", "TensorBoardCallback", "Trainer", "WandbCallback", "plot_metrics", "read_metrics"]
