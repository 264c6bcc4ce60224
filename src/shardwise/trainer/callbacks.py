"""Callbacks: objects with any of ``on_train_start``, ``on_step_end``, ``on_log``, ``on_eval_end``, ``on_save``,
``on_train_end``.

Every hook runs on every rank and receives the trainer first.  A callback
that wants a checkpoint now or the run to end calls ``trainer.request_save()``
or ``trainer.request_stop(reason)``; the trainer turns that into a decision all
ranks take together at the end of the step (no rank saves alone; a stop asked
on one rank stops all).  Subclassing :class:`Callback` is optional: any object
with some of the hooks works.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from .loop import FitSummary, Trainer

__all__ = ["HOOKS", "Callback", "CallbackList", "TensorBoardCallback"]

HOOKS = ("on_train_start", "on_step_end", "on_log", "on_eval_end", "on_save", "on_train_end")


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


class CallbackList:
    """Calls a hook on every callback that has it, in order."""

    def __init__(self, callbacks: Iterable[Any]) -> None:
        self.callbacks = list(callbacks)
        for callback in self.callbacks:
            if not any(callable(getattr(callback, hook, None)) for hook in HOOKS):
                raise TypeError(
                    f"callback {callback!r} of type `{type(callback).__name__}` has none of the hooks {list(HOOKS)}; "
                    "define at least one (or subclass `shardwise.trainer.Callback`)"
                )

    def call(self, hook: str, trainer: "Trainer", *args: Any) -> None:
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if callable(method):
                method(trainer, *args)


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
