"""Callbacks: objects with any of ``on_train_start``, ``on_step_end``, ``on_log``, ``on_eval_end``, ``on_save``,
``on_train_end``.

Every hook runs on every rank and receives the trainer first.  A callback
that wants a checkpoint now or the run to end calls ``trainer.request_save()``
or ``trainer.request_stop(reason)``; the trainer turns that into a decision all
ranks take together at the end of the step (no rank saves alone; a stop asked
on one rank stops all).  Subclassing :class:`Callback` is optional: any object
with some of the hooks works: the loop calls them by name (:class:`.control.CallbackList`)
and knows nothing of this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from .best import Watch

if TYPE_CHECKING:
    from .loop import FitSummary, Trainer

__all__ = ["Callback", "EarlyStopping", "TensorBoardCallback"]


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

    ``writer`` may be any object with ``add_scalar(tag, value, step)`` (and
    optionally ``flush``/``close``); by default a
    ``torch.utils.tensorboard.SummaryWriter(log_dir)`` is made on rank 0 when
    training starts.
    """

    SCALARS = ("loss", "lr", "grad_norm", "loss_scale", "tokens_per_s", "samples_per_s", "eval_loss")

    def __init__(self, log_dir: Optional[str] = None, writer: Any = None) -> None:
        self.log_dir = log_dir
        self.writer = writer

    def on_train_start(self, trainer: "Trainer") -> None:
        if self.writer is None and trainer.rank == 0:
            self.writer = _summary_writer(self.log_dir)

    def _write(self, trainer: "Trainer", metrics: dict[str, Any]) -> None:
        if self.writer is None or trainer.rank != 0:
            return
        for key in self.SCALARS:
            value = metrics.get(key)
            if isinstance(value, (int, float)):
                self.writer.add_scalar(f"train/{key}" if key != "eval_loss" else "eval/loss", value, metrics["step"])

    def on_step_end(self, trainer: "Trainer", metrics: dict[str, Any]) -> None:
        self._write(trainer, metrics)

    def on_eval_end(self, trainer: "Trainer", metrics: dict[str, Any]) -> None:
        self._write(trainer, metrics)

    def on_train_end(self, trainer: "Trainer", summary: "FitSummary") -> None:
        close = getattr(self.writer, "close", None)
        if callable(close):
            close()


def _summary_writer(log_dir: Optional[str]) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter  # here: heavy, optional, only for this callback
    except ImportError as error:
        raise ImportError(
            f"`TensorBoardCallback` needs the `tensorboard` package ({error}); install it with "
            "`pip install 'shardwise[tensorboard]'`, or pass `writer=` an object with `add_scalar`"
        ) from error
    return SummaryWriter(log_dir=log_dir)


class EarlyStopping(Callback):
    """Stops training once ``patience`` evaluations in a row did not improve ``metric`` by more than ``min_delta``."""

    def __init__(self, metric: str = "eval_loss", patience: int = 3, greater_is_better: bool = False,
                 min_delta: float = 0.0) -> None:
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"`EarlyStopping(patience={patience!r})`: expected an integer >= 1")
        self.watch = Watch(metric, greater_is_better, min_delta)
        self.patience = patience
        self.waited = 0

    def on_eval_end(self, trainer: "Trainer", metrics: dict[str, Any]) -> None:
        if self.watch.update(metrics):
            self.waited = 0
            return
        self.waited += 1
        if self.waited >= self.patience:
            trainer.request_stop(
                f"early stopping: `{self.watch.name}` has not improved on {self.watch.best:.6g} (step "
                f"{self.watch.best_step}) for {self.waited} evaluation(s)")
