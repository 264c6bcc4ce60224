"""``Trainer``: the training loop on top of an :class:`~shardwise.Engine`.

Per step: ``gradient_accumulation_steps`` micro-batches through ``engine(...)``, ``engine.backward`` and ``engine.step``
(:meth:`Trainer.train_step`, the one method a pipeline variant would override), then one all-reduce of the step's loss
and data counts, evaluation when due, the callbacks, and one all-reduce of the callbacks' stop/save requests (so every
rank saves at the same step). The data position (epoch, step within it) travels in the checkpoint's ``client_state``,
so a resumed run continues with the very next batch and ends bit-for-bit where an uninterrupted run ends.  Building
the engine from a model, and everything else a user sees: docs/trainer.md.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..comm.distributed import init_distributed
from ..config import Config
from ..engine.initialization import initialize
from .batch import LossFn, compute_loss, forward, measure, positional_arity, to_device
from .checkpoints import Checkpoints
from .control import Agreement, CallbackList, Decision, Requests
from .data import Collate, Source, eval_source, train_source
from .evaluation import Collected, ComputeMetrics, Watch
from .metrics import Meter, MetricsFile
from .progress import make_progress, routed_logs

__all__ = ["FitSummary", "StepResult", "Trainer"]

_STATE_VERSION = 1
#: steps between log records when `log_every` is not given: dense enough for a curve, cheap (one small gather)
DEFAULT_LOG_EVERY = 10


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step reports on this rank: its micro-batches' summed loss and data counts."""

    loss_sum: float
    micro_batches: int
    samples: int
    tokens: int


@dataclass(frozen=True)
class FitSummary:
    """What :meth:`Trainer.fit` returns."""

    #: the engine's optimizer steps at the end (``engine.global_steps``)
    steps: int
    #: steps trained by this ``fit()`` call (fewer than ``steps`` after a resume)
    trained_steps: int
    #: the epoch the data position is in at the end
    epoch: int
    #: the last step's loss, averaged over ranks and micro-batches (NaN if no step ever ran)
    final_loss: float
    #: the last evaluation's loss (None without ``eval_data``)
    eval_loss: Optional[float]
    #: seconds this ``fit()`` took
    elapsed: float
    #: training throughput (evaluation and saves left out), over all ranks
    samples_per_second: float
    #: None when the batches are not token ids
    tokens_per_second: Optional[float]
    #: the reason when a callback stopped the run early
    stopped: Optional[str]
    #: the newest checkpoint (None without ``checkpoint_dir``)
    checkpoint: Optional[str]
    #: the checkpoint with the best ``best_metric`` (None without one, or without ``checkpoint_dir``)
    best_checkpoint: Optional[str] = None
    #: the best value of ``best_metric`` seen
    best_metric: Optional[float] = None
    #: the curves PNG written next to ``metrics_file`` (None when none was drawn)
    plot: Optional[str] = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Trainer:
    """Trains ``engine`` (or a model, with ``config``) on ``train_data`` for ``max_steps`` steps or ``epochs`` epochs,
    whichever ends first; every argument (checkpoints, resume, evaluation, callbacks) in ``docs/trainer.md``."""

    def __init__(
        self,
        model_or_engine: Any,
        train_data: Any,
        *,
        config: Any = None,
        max_steps: Optional[int] = None,
        epochs: Optional[int] = None,
        eval_data: Any = None,
        eval_every: Optional[int] = None,
        compute_metrics: Optional[ComputeMetrics] = None,
        checkpoint_dir: Optional[str] = None,
        save_every: Optional[int] = None,
        keep_last: Optional[int] = None,
        best_metric: Optional[str] = None,
        greater_is_better: bool = False,
        resume: bool = True,
        callbacks: Iterable[Any] = (),
        log_every: Optional[int] = None,
        progress: bool = True,
        loss_fn: Optional[LossFn] = None,
        collate_fn: Collate = None,
        num_workers: int = 0,
        seed: int = 0,
        metrics_file: Optional[str] = None,
    ) -> None:
        _check_arguments(max_steps, epochs, eval_every, eval_data, save_every, keep_last, checkpoint_dir, log_every,
                         best_metric, compute_metrics)
        engine = build_engine(model_or_engine, config, train_data, max_steps, epochs)
        self.engine = engine
        self.max_steps, self.epochs = max_steps, epochs
        self.eval_every, self.save_every = eval_every, save_every
        self.resume_enabled, self.loss_fn, self.seed = resume, loss_fn, seed
        self.rank, self.world_size = engine.comm.rank, engine.comm.world_size
        self.device = next((p.device for p in engine.module.parameters()), torch.device("cpu"))
        # With a loss_fn, trailing tuple items the forward cannot take are its targets (see batch.py).
        self.arity = positional_arity(engine.module) if loss_fn is not None else None
        self.compute_metrics = compute_metrics
        self.watch = Watch(best_metric, greater_is_better) if best_metric is not None else None
        self.agreement = Agreement(engine.comm, self.device)
        self.accumulation = engine.gradient_accumulation_steps()
        try:  # None: the config sets no batch size (fine with a user-built DataLoader)
            self.micro: Optional[int] = int(engine.train_micro_batch_size_per_gpu())
        except ValueError:
            self.micro = None
        where = dict(micro=self.micro, rank=self.rank, world=self.world_size, collate_fn=collate_fn, num_workers=num_workers)
        self.source = train_source(train_data, seed=seed, **where)
        self.eval_source: Optional[Source] = eval_source(eval_data, **where) if eval_data is not None else None
        self._check_size(self.source.batches_per_epoch)
        self.checkpoints = Checkpoints(engine, checkpoint_dir, keep_last)
        self.callbacks = CallbackList(callbacks)
        self.metrics = MetricsFile(metrics_file, self.rank == 0)
        self.progress = make_progress(self.rank, progress)
        # Its own cadence: a config quieting the engine (`steps_per_print: 1000`) must not thin the metrics.
        self.log_every = log_every or DEFAULT_LOG_EVERY
        #: the data position: the epoch, and the optimizer steps already taken in it
        self.epoch, self.step_in_epoch = 0, 0
        self.last_loss = math.nan
        self.last_eval_loss: Optional[float] = None
        self._requests = Requests()
        self._steps_per_epoch: Optional[int] = None
        self._evaluated_at: Optional[int] = None
        self._logged_at: Optional[int] = None

    # ------------------------------------------------------------ requests
    @property
    def global_step(self) -> int:
        """Optimizer steps so far (``engine.global_steps``, restored on resume)."""
        return int(self.engine.global_steps)

    def request_stop(self, reason: str = "a callback asked to stop") -> None:
        """Stop after this step, on every rank (saving first when there is a ``checkpoint_dir``)."""
        self._requests.stop_reason = reason

    def request_save(self) -> None:
        """Save a checkpoint after this step, on every rank."""
        self._requests.save = True

    # ------------------------------------------------------------ checks
    def _global_batch(self) -> Optional[int]:
        return self.micro * self.accumulation * self.world_size if self.micro is not None else None

    def _check_size(self, batches: Optional[int]) -> None:
        if batches is None or batches // self.accumulation > 0:
            return
        samples = self.source.samples
        if self.micro is not None and samples is not None:
            raise ValueError(
                f"`train_data` has {samples} samples, fewer than one global batch: `train_batch_size` = micro batch "
                f"{self.micro} x accumulation {self.accumulation} x {self.world_size} rank(s) = {self._global_batch()} "
                "(per epoch, each rank drops what does not fill a whole step); use more data or a smaller batch")
        raise ValueError(
            f"`train_data` gives rank {self.rank} {batches} micro-batches per epoch, fewer than the "
            f"{self.accumulation} one optimizer step needs (`gradient_accumulation_steps`); use more data or "
            "a smaller batch")

    # ------------------------------------------------------------ the loop
    def fit(self) -> FitSummary:
        """Train until ``max_steps``/``epochs`` (or a stop request); returns a :class:`FitSummary`."""
        resumed_from = self._resume() if self.resume_enabled else None
        if self.source.batches_per_epoch is not None:
            self._steps_per_epoch = int(self.agreement.min([self.source.batches_per_epoch // self.accumulation])[0])
            self._check_size(self._steps_per_epoch * self.accumulation)
        self.metrics.start(resumed_from)
        if resumed_from is not None and (self._finished() or (self.epochs is not None and self.epoch >= self.epochs)):
            return self._nothing_to_do()
        self.progress.start(steps_to_run(self.max_steps, self.epochs, self._steps_per_epoch), self.global_step)
        self.callbacks.call("on_train_start", self)
        meter = Meter()
        try:
            with routed_logs(self.progress.message) if self.rank == 0 else contextlib.nullcontext():
                decision, groups = Decision(), self._batch_groups()
                while not self._finished() and (batches := next(groups, None)) is not None:
                    decision = self._one_step(batches, meter)
                    if decision.stop:
                        break
                return self._finish(meter, decision)
        except BaseException:
            self.progress.close()  # leave the terminal clean for the traceback
            raise

    def _one_step(self, batches: list[Any], meter: Meter) -> Decision:
        result = self.train_step(batches)
        self.step_in_epoch += 1
        metrics = self._record_step(result, meter)
        if self.eval_every and self.global_step % self.eval_every == 0:
            with meter.paused():
                self.evaluate()
        self.callbacks.call("on_step_end", self, metrics)
        decision = self._requests.decide(self.agreement, self.rank)
        if decision.stop:
            who = "" if self.world_size == 1 else f" (asked on rank {decision.asked_by})"
            self.progress.message(f"stopping at step {self.global_step}: {decision.reason}{who}")
        due = self.save_every is not None and self.global_step % self.save_every == 0
        if self.checkpoints.enabled and (decision.save or decision.stop or due):
            with meter.paused():
                self.save()
        return decision

    def train_step(self, batches: list[Any]) -> StepResult:
        """One optimizer step over ``batches`` (``gradient_accumulation_steps`` micro-batches) on this rank.

        A pipeline engine's variant would override this alone (with ``engine.train_batch``).
        """
        losses = []
        samples = tokens = 0
        for batch in batches:
            batch = to_device(batch, self.device)
            loss = compute_loss(forward(self.engine, batch, self.arity), batch, self.loss_fn)
            self.engine.backward(loss)
            self.engine.step()
            losses.append(loss.detach().float())
            batch_samples, batch_tokens = measure(batch)
            samples += batch_samples
            tokens += batch_tokens or 0
        return StepResult(float(torch.stack(losses).sum().item()), len(batches), samples, tokens)

    def _batch_groups(self) -> Iterator[list[Any]]:
        """Each step's micro-batches, epoch after epoch, from the current data position on."""
        while self.epochs is None or self.epoch < self.epochs:
            limit = self._steps_per_epoch
            batches = self.source.epoch(self.epoch, skip=self.step_in_epoch * self.accumulation)
            while limit is None or self.step_in_epoch < limit:
                group = list(itertools.islice(batches, self.accumulation))
                # A source without a length can run dry unevenly: the epoch ends when any rank's does.
                if limit is None and not self.agreement.min([float(len(group) == self.accumulation)])[0] > 0:
                    break
                yield group
            if self.step_in_epoch == 0:
                self._check_size(0)  # an iterable source that never filled one step
            self.epoch, self.step_in_epoch = self.epoch + 1, 0

    def _finished(self) -> bool:
        return self.max_steps is not None and self.global_step >= self.max_steps

    # ------------------------------------------------------------ metrics
    def _record_step(self, result: StepResult, meter: Meter) -> dict[str, Any]:
        loss_sum, micro, samples, tokens = self.agreement.sum(
            [result.loss_sum, result.micro_batches, result.samples, result.tokens])
        self.last_loss = loss_sum / micro
        rates = meter.add(int(samples), int(tokens))
        metrics = self._step_metrics()
        self.progress.step({**metrics, **rates})
        if self.global_step % self.log_every == 0:
            self._log(metrics, meter)
        return metrics

    def _step_metrics(self) -> dict[str, Any]:
        lrs = self.engine.get_lr()
        return {"step": self.global_step, "epoch": self.epoch, "loss": self.last_loss,
                "lr": float(lrs[0]) if lrs else math.nan}

    def _log(self, metrics: dict[str, Any], meter: Meter) -> None:
        memory = self.agreement.gather(self.engine.memory_breakdown())  # collective: every rank logs this step
        record = {
            **metrics,
            "grad_norm": self.engine.get_global_grad_norm(),
            "loss_scale": float(self.engine.loss_scale),
            **meter.interval(),
            "memory": memory,
        }
        self._logged_at = self.global_step
        self.metrics.write(record)
        self.progress.log(record)
        self.callbacks.call("on_log", self, record)

    # ------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> Optional[float]:
        """The loss over all of ``eval_data`` (every rank's share, weighted by samples); collective."""
        if self.eval_source is None:
            return None
        was_training = self.engine.module.training
        self.engine.eval()
        collected = Collected() if self.compute_metrics is not None else None
        try:
            loss_sum, samples = self._eval_sums(self.eval_source.epoch(0), collected)
        finally:
            self.engine.train(was_training)
        total_loss, total_samples = self.agreement.sum([loss_sum, samples])
        self.last_eval_loss = total_loss / total_samples
        self._evaluated_at = self.global_step
        metrics: dict[str, Any] = {"step": self.global_step, "epoch": self.epoch, "eval_loss": self.last_eval_loss}
        if collected is not None and self.compute_metrics is not None:
            metrics.update(collected.compute(self.agreement.gather, self.compute_metrics))
        self.metrics.write(metrics)
        self.progress.message(f"eval at step {self.global_step}: " + ", ".join(
            f"{key.removeprefix('eval_')} {value:.4f}" for key, value in metrics.items() if key.startswith("eval_")))
        self._watch(metrics)
        self.callbacks.call("on_log", self, metrics)
        self.callbacks.call("on_eval_end", self, metrics)
        return self.last_eval_loss

    def _watch(self, metrics: dict[str, Any]) -> None:
        """A new best ``best_metric``: keep this step's checkpoint (saving it at the end of the step)."""
        if self.watch is None or not self.watch.update(metrics):
            return
        if self.checkpoints.enabled:
            self.checkpoints.mark_best(self.global_step)
            self.request_save()  # every rank saw the same (reduced) metrics, so every rank asks

    def _eval_sums(self, batches: Iterator[Any], collected: Optional[Collected]) -> tuple[float, float]:
        """This rank's summed loss x samples and samples; ranks that run dry first repeat a batch at weight 0.

        Every rank runs the same number of forwards, which a stage 3 engine needs (its forward gathers collectively).
        """
        loss_sum = samples = 0.0
        last = None
        while True:
            batch = next(batches, None)
            more, starved = self.agreement.max([float(batch is not None), float(batch is None and last is None)])
            if not more:
                return loss_sum, samples
            if starved:
                raise ValueError(
                    f"`eval_data` gives some rank no batch at all while others have some ({self.world_size} ranks); "
                    "use an eval set of at least one micro-batch per rank")
            weight = 1.0 if batch is not None else 0.0
            batch = to_device(batch if batch is not None else last, self.device)
            output = forward(self.engine, batch, self.arity)
            loss = compute_loss(output, batch, self.loss_fn)
            if collected is not None and weight:
                collected.add(output, batch)
            n = measure(batch)[0] * weight
            loss_sum += float(loss.float().item()) * n
            samples += n
            last = batch

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The trainer's own state (data position and counters), stored in the checkpoint's ``client_state``."""
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "train_batch_size": self._global_batch(),
            "seed": self.seed,
            "last_loss": None if math.isnan(self.last_loss) else self.last_loss,
            "last_eval_loss": self.last_eval_loss,
            "evaluated_at": self._evaluated_at,
            "best": None if self.watch is None else [self.watch.best, self.watch.best_step],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a different global batch size keeps the position in samples."""
        self.epoch, self.step_in_epoch = int(state["epoch"]), int(state["step_in_epoch"])
        saved_batch, batch = state.get("train_batch_size"), self._global_batch()
        if saved_batch and batch and saved_batch != batch:
            samples = self.step_in_epoch * saved_batch
            self.step_in_epoch = samples // batch
            if samples % batch:
                warnings.warn(
                    f"the checkpoint's global batch was {saved_batch}, this run's is {batch}: {samples % batch} "
                    f"sample(s) of epoch {self.epoch} are skipped to resume on a step boundary",
                    stacklevel=3,
                )
        if state.get("seed") != self.seed:
            warnings.warn(f"the checkpoint was trained with seed={state.get('seed')}, this trainer has seed={self.seed}: "
                          "the data order from here on differs from the saved run's", stacklevel=3)
        last = state.get("last_loss")
        self.last_loss = math.nan if last is None else float(last)
        self.last_eval_loss = state.get("last_eval_loss")
        self._evaluated_at = state.get("evaluated_at")
        best = state.get("best")
        if self.watch is not None and best is not None and best[1] is not None:
            self.watch.best, self.watch.best_step = best
            self.checkpoints.best_step = int(best[1])

    def save(self) -> Optional[str]:
        """Save a checkpoint now (collective: every rank calls it); skipped if this step is already saved."""
        if not self.checkpoints.enabled or self.checkpoints.last_step == self.global_step:
            return self.checkpoints.last_path
        path = self.checkpoints.save({"trainer": self.state_dict()})
        self.progress.message(f"saved {path}")
        self.callbacks.call("on_save", self, path)
        return path

    def _resume(self) -> Optional[int]:
        client_state = self.checkpoints.resume()
        if client_state is None:
            return None
        state = client_state.get("trainer")
        if state is None:
            warnings.warn(f"{self.checkpoints.last_path} has no trainer state (it was saved outside the Trainer): "
                          "the weights are restored, the data starts from the first batch", stacklevel=3)
        else:
            self.load_state_dict(state)
        self.progress.message(
            f"resumed from {self.checkpoints.last_path}: step {self.global_step}, epoch {self.epoch} "
            f"(step {self.step_in_epoch} of it)")
        return self.global_step

    # ------------------------------------------------------------ the end
    def _finish(self, meter: Meter, decision: Decision) -> FitSummary:
        if meter.steps and self._logged_at != self.global_step:
            self._log(self._step_metrics(), meter)
        self.save()
        if self.eval_source is not None and self._evaluated_at != self.global_step:
            self.evaluate()
        self.progress.close()
        seconds = meter.training_seconds()
        summary = self._summary(
            trained_steps=meter.total_steps, elapsed=meter.elapsed(), samples_per_second=meter.total_samples / seconds,
            tokens_per_second=meter.total_tokens / seconds if meter.total_tokens else None,
            stopped=decision.reason if decision.stop else None, plot=self.metrics.plot(self.progress.message))
        self.progress.message(_describe(summary))
        self.callbacks.call("on_train_end", self, summary)
        return summary

    def _summary(self, **fields: Any) -> FitSummary:
        best = self.watch.best if self.watch is not None else None
        return FitSummary(
            steps=self.global_step, epoch=self.epoch, final_loss=self.last_loss, eval_loss=self.last_eval_loss,
            checkpoint=self.checkpoints.last_path, best_checkpoint=self.checkpoints.path_of(self.checkpoints.best_step),
            best_metric=best, **fields)

    def _nothing_to_do(self) -> FitSummary:
        """A resumed run already at its end: say so, write nothing (no eval record twice, no save)."""
        goal = f"`max_steps={self.max_steps}`" if self._finished() else f"`epochs={self.epochs}`"
        self.progress.message(
            f"nothing to train: {self.checkpoints.last_path} is at step {self.global_step}, which already reaches "
            f"{goal}; raise it to train further, or start over in a new `checkpoint_dir`")
        summary = self._summary(trained_steps=0, elapsed=0.0, samples_per_second=0.0, tokens_per_second=None,
                                stopped=None, plot=None)
        self.callbacks.call("on_train_end", self, summary)
        return summary


def _describe(summary: FitSummary) -> str:
    rate = (f"{summary.tokens_per_second:,.0f} tokens/s" if summary.tokens_per_second is not None
            else f"{summary.samples_per_second:,.1f} samples/s")
    line = f"trained {summary.trained_steps} step(s) in {summary.elapsed:.1f}s (now at step {summary.steps}); final loss {summary.final_loss:.4f}; {rate}"
    if summary.eval_loss is not None:
        line += f"; eval loss {summary.eval_loss:.4f}"
    return line


def _check_arguments(max_steps: Optional[int], epochs: Optional[int], eval_every: Optional[int], eval_data: Any,
                     save_every: Optional[int], keep_last: Optional[int], checkpoint_dir: Optional[str],
                     log_every: Optional[int], best_metric: Optional[str], compute_metrics: Any) -> None:
    if max_steps is None and epochs is None:
        raise ValueError("the Trainer needs to know when to stop: pass `max_steps=N` (optimizer steps), `epochs=N`, or both")
    if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 0):
        raise ValueError(f"`max_steps={max_steps!r}`: expected an integer >= 0")
    for name, value in (("epochs", epochs), ("eval_every", eval_every), ("save_every", save_every),
                        ("keep_last", keep_last), ("log_every", log_every)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"`{name}={value!r}`: expected a positive integer (or None)")
    if eval_every is not None and eval_data is None:
        raise ValueError(f"`eval_every={eval_every}` without `eval_data`: pass the data to evaluate on")
    if (save_every is not None or keep_last is not None) and checkpoint_dir is None:
        raise ValueError("`save_every`/`keep_last` need a `checkpoint_dir` to save into")
    if best_metric is not None and eval_data is None:
        raise ValueError(f"`best_metric={best_metric!r}` without `eval_data`: the best checkpoint is judged on "
                         "evaluations; pass `eval_data=` (and `eval_every=`)")
    if compute_metrics is not None and not callable(compute_metrics):
        raise TypeError(f"`compute_metrics` is a {type(compute_metrics).__name__}; expected a callable "
                        "`(predictions, labels) -> dict`")


#: the config path a Trainer settles when it is ``auto``
TOTAL_STEPS = "scheduler.params.total_num_steps"


def build_engine(model_or_engine: Any, config: Any, train_data: Any, max_steps: Optional[int],
                 epochs: Optional[int]) -> Any:
    """``model_or_engine`` if it is an engine; otherwise ``shardwise.initialize(model, config=...)``."""
    if not isinstance(model_or_engine, nn.Module):
        if config is not None:
            raise ValueError(
                "`config=` was passed with an engine: the engine already has its config; pass the model "
                "(`Trainer(model, data, config=...)`) to have the Trainer build the engine, or drop `config=`")
        return model_or_engine
    if config is None:
        raise ValueError(
            f"`Trainer` got a `{type(model_or_engine).__name__}` model but no config: pass `config=` (a dict, a "
            "`.json`/`.yaml` path or a `shardwise.Config`), or an engine from `shardwise.initialize`")
    loaded = Config.load(config)
    if not dist.is_initialized():
        init_distributed(timeout=loaded.dist_timeout)
    if TOTAL_STEPS in loaded.pending:
        world = dist.get_world_size()
        total = planned_steps(train_data, loaded, world, max_steps, epochs)
        loaded = loaded.resolve(world_size=world, model=model_or_engine, total_num_steps=total)
    return initialize(model_or_engine, config=loaded)


def planned_steps(data: Any, config: Config, world: int, max_steps: Optional[int], epochs: Optional[int]) -> int:
    """The optimizer steps a Trainer will run, known before it starts; an error says when it cannot be."""
    sizes = config.batch_sizes(world)
    batches = train_source(data, micro=sizes.micro_batch_size, rank=dist.get_rank(), world=world, seed=0,
                           collate_fn=None, num_workers=0).batches_per_epoch  # counted as the Trainer will count them
    per_epoch = batches // sizes.gradient_accumulation_steps if batches is not None else None
    total = steps_to_run(max_steps, epochs, per_epoch)
    if total is None:
        raise ValueError(
            f"`{TOTAL_STEPS}` is `auto`, and `train_data` ({type(data).__name__}) has no length, so `epochs={epochs}` "
            "gives no step count: pass `max_steps=N` too, or set the scheduler's `total_num_steps` to a number")
    return max(total, 1)


def steps_to_run(max_steps: Optional[int], epochs: Optional[int], per_epoch: Optional[int]) -> Optional[int]:
    """``max_steps`` or ``epochs`` x ``per_epoch``, whichever ends first (None when neither is known)."""
    by_epochs = epochs * per_epoch if epochs is not None and per_epoch is not None else None
    candidates = [steps for steps in (max_steps, by_epochs) if steps is not None]
    return min(candidates) if candidates else None
