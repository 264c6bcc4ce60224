"""The pipeline engine: 1F1B over the stages of a replica, ZeRO 0/1 across replicas (docs/pipeline.md).

It is an :class:`~shardwise.Engine` over this rank's stage and its data-parallel group, so precision, the ZeRO strategy,
the optimizer wrapper, the scheduler and the getters are a plain engine's; it adds ``train_batch``, ``eval_batch`` and
whole-model checkpoints and ``full_state_dict``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, NoReturn, Optional

import torch
import torch.distributed as dist

from ..comm.agreement import join
from ..comm.construction import digests, require_same_construction
from ..comm.distributed import Comm
from ..comm.fingerprint import config_fingerprint
from ..config import Config
from ..engine.engine import Engine
from ..faults.announce import Announcer, collective
from ..model_io.export import save_state_dict
from ..zero.flat.strategy import FlatStrategy
from .checkpointing import PipelineState, global_order
from .layers import compute_loss
from .module import PipelineModule
from .p2p import Channel, gather_to_first, working_copy
from .schedule import Action, Phase, forward_only, one_f_one_b
from .ties import TiedWeights
from .topology import PipeGroups

__all__ = ["PipelineEngine", "ScheduleTiming"]


@dataclass
class ScheduleTiming:
    """Where the last batch's time went on this rank (seconds): ``compute`` in forward and backward, the rest of
    ``total`` waiting (bubble, transfers; ``benchmarks/pipeline.py`` divides by the slowest rank's ``total``)."""

    total: float = 0.0
    compute: float = 0.0


#: a batch's micro-batches as drawn, ``(inputs, labels)`` each (empty on the middle stages)
_Batch = list[tuple[Any, Any]]


class PipelineEngine(Engine):
    """A :class:`PipelineModule` with ``num_stages > 1``, trained with ``train_batch``.

    Built by :func:`shardwise.initialize`.  The world is ``num_stages``
    stages × data-parallel replicas; ``engine.module`` is this rank's stage.
    """

    def __init__(
        self,
        module: PipelineModule,
        config: Config,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        model_parameters: Any = None,
        process_group: Optional[dist.ProcessGroup] = None,
        name: Optional[str] = None,
    ) -> None:
        _check_pipeline_config(module, config, process_group)
        assert module.topology is not None  # num_stages > 1
        _agree_on_construction(module, config, name)
        tie_stages = [module.stages_of_tie(key) for key in module.tied_keys]
        self.groups = PipeGroups.create(module.topology, [s for s in tie_stages if len(s) > 1])
        self.ties = TiedWeights(module, self.groups)
        self.ties.broadcast()  # tied copies start equal, before master weights are taken
        super().__init__(
            module, config, optimizer=optimizer, lr_scheduler=lr_scheduler,
            model_parameters=model_parameters, process_group=self.groups.data.group, name=name,
        )
        self.module: PipelineModule = module
        # Its collective calls span every stage: they announce over the whole world, not one stage's replicas.
        self._announcer = Announcer(self.groups.world, self._label, self._counters)
        # The step sees the whole model: the norm (clipping, overflow) summed over every stage, each tied
        # weight once (on the first stage holding it).
        assert isinstance(self.strategy, FlatStrategy)  # stages 0-1 (_check_pipeline_config)
        self.strategy.count_elsewhere(self.ties.copies())
        if self.optimizer is not None:
            self.optimizer.model_parallel_comm = self.groups.pipe
        first = next(module.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
        self.channel = Channel(self.groups.p2p, module.stage_id, module.num_stages, device)
        #: where the last ``train_batch``/``eval_batch`` spent its time on this rank
        self.timing = ScheduleTiming()
        #: what ``train_batch()`` / ``eval_batch()`` draw from when given no iterator (DeepSpeed's name)
        self.data_iterator: Any = None

    def set_dataloader(self, loader: Any) -> None:
        """Draw from ``iter(loader)`` when ``train_batch``/``eval_batch`` get no iterator (as DeepSpeed's;
        ``shardwise.deepspeed.initialize(training_data=...)`` sets a repeating loader here)."""
        self.data_iterator = iter(loader)

    def set_dataiterator(self, iterator: Any) -> None:
        """Draw from ``iterator`` when ``train_batch``/``eval_batch`` get none."""
        self.data_iterator = iterator

    # ------------------------------------------------------------ the API
    @collective("train_batch")
    def train_batch(self, data_iter: Any = None) -> torch.Tensor:
        """Train on ``gradient_accumulation_steps`` micro-batches ``(inputs, labels)`` from ``data_iter`` and take one
        optimizer step; returns their mean loss on every rank (each step: docs/pipeline.md, "engine.train_batch").
        Without ``data_iter``, from the engine's own (:meth:`set_dataloader`); one given becomes it, as in DeepSpeed."""
        optimizer = self._require_optimizer("`engine.train_batch`")
        if self.config.auto_refresh_trainable and self.strategy.trainable_changed():
            self.refresh_trainable()
        steps = self.gradient_accumulation_steps()
        batch = self._take(self.data_iterator if data_iter is None else data_iter, steps, "train_batch")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        self._sync_buffers()  # over this stage's data-parallel replicas
        losses = self._execute(one_f_one_b(self.module.stage_id, self.module.num_stages, steps), batch, steps)
        try:
            self.ties.check_untied()
        except RuntimeError:
            self.strategy.zero_grad()  # the batch is dropped; the engine stays usable
            raise
        self.ties.reduce_grads()
        # Every bucket, reduced over the data-parallel group (launched and waited).
        self.strategy.start_backward(True)
        self.strategy.finish_backward()
        with self._timed("step"):
            if optimizer.step(zero_grad=True):  # the update, then the gradients dropped: one call
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step()
            else:
                self.skipped_steps += 1
            self.global_steps += 1
            self.micro_steps += steps
        if self.module.is_first_stage:
            self._report()
        return self._mean_loss(losses)

    @collective("eval_batch")
    def eval_batch(self, data_iter: Any = None, num_micro_batches: Optional[int] = None) -> torch.Tensor:
        """Mean loss of ``num_micro_batches`` (default: ``gradient_accumulation_steps``) micro-batches,
        on every rank; no gradient, no state changes (dropout off during the call). Without ``data_iter``:
        from the engine's own iterator (:meth:`set_dataloader`), which a given one does not replace."""
        steps = num_micro_batches or self.gradient_accumulation_steps()
        batch = self._take(self.data_iterator if data_iter is None else data_iter, steps, "eval_batch")
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                losses = self._execute(forward_only(steps), batch, steps)
        finally:
            self.module.train(was_training)
        return self._mean_loss(losses)

    def forward(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(self._not_here("engine(...)"))

    __call__ = forward

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> NoReturn:
        raise RuntimeError(self._not_here("engine.backward(loss)"))

    def step(self) -> NoReturn:
        raise RuntimeError(self._not_here("engine.step()"))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        raise RuntimeError(self._not_here("engine.no_sync()"))
        yield  # pragma: no cover

    def _not_here(self, call: str) -> str:
        module = self.module
        return (
            f"`{call}` is not available on a pipeline engine: this rank holds only stage {module.stage_id} of "
            f"{module.num_stages}, and forward, backward and step run together over all stages. Call "
            "`engine.train_batch(data_iter)` to train (it runs `gradient_accumulation_steps` micro-batches and "
            "steps), or `engine.eval_batch(data_iter)` to evaluate")

    # ------------------------------------------------------------ data
    def _take(self, data_iter: Any, steps: int, call: str) -> _Batch:
        """``steps`` micro-batches on the first and last stage, checked on every rank before any transfer
        (a rank that runs out mid-batch makes every rank raise instead of leaving its peers waiting)."""
        if data_iter is None:
            raise TypeError(
                f"rank {self.groups.world.rank}: `engine.{call}()` got no data_iter and the engine has none of its "
                f"own; pass `engine.{call}(iter(loader))`, or `training_data=` to `shardwise.deepspeed.initialize` "
                "(or call `engine.set_dataloader(loader)`) to draw from a loader without passing it")
        if not hasattr(data_iter, "__next__"):
            raise TypeError(
                f"`engine.{call}(data_iter)` needs an iterator of `(inputs, labels)` micro-batches, got "
                f"`{type(data_iter).__name__}`; pass `iter(loader)` and keep it between calls")
        batch: _Batch = []
        got: Optional[int] = steps
        problem = ""
        if self.module.is_first_stage or self.module.is_last_stage:
            got, problem = _draw(data_iter, steps, batch)
        counts = torch.full((self.groups.world.world_size,), steps, dtype=torch.int64, device=self.channel.device)
        counts[self.groups.world.rank] = -1 if got is None else got
        self.groups.world.all_reduce(counts, op=dist.ReduceOp.MIN)
        short = {rank: int(c) for rank, c in enumerate(counts.tolist()) if c < steps}
        if short:
            raise RuntimeError(_data_error(call, steps, short, self.groups.world.rank, problem if got is None else None))
        return batch

    # ------------------------------------------------------------ schedule
    def _execute(self, schedule: list[Action], batch: _Batch, steps: int) -> list[torch.Tensor]:
        """Run this stage's actions; returns the last stage's per-micro-batch losses."""
        stash: dict[int, tuple[Any, Any]] = {}
        losses: list[torch.Tensor] = []
        start, self.timing = time.perf_counter(), ScheduleTiming()
        for action in schedule:
            if action.phase is Phase.FORWARD:
                self._forward(action.micro_batch, batch, stash, losses)
            else:
                self._backward(action.micro_batch, stash, steps)
        self.channel.flush()
        self.timing.total = time.perf_counter() - start
        return losses

    def _forward(self, micro: int, batch: _Batch, stash: dict[int, tuple[Any, Any]], losses: list[torch.Tensor]) -> None:
        module = self.module
        inputs = self.precision.cast_inputs(batch[micro][0]) if module.is_first_stage else self.channel.recv_activation()
        started = time.perf_counter()
        outputs = module(inputs if module.is_first_stage else working_copy(inputs))
        if module.is_last_stage:
            outputs = compute_loss(module.loss_fn, outputs, self.precision.cast_inputs(batch[micro][1]))
            losses.append(outputs.detach().float().reshape(()))
        self.timing.compute += time.perf_counter() - started
        if not module.is_last_stage:
            self.channel.send_activation(outputs)
        if torch.is_grad_enabled():
            stash[micro] = (inputs, outputs)

    def _backward(self, micro: int, stash: dict[int, tuple[Any, Any]], steps: int) -> None:
        module = self.module
        inputs, outputs = stash.pop(micro)
        grads: list[Optional[torch.Tensor]]
        if module.is_last_stage:
            # loss scale, the average over micro-batches, and (for summing strategies) over replicas
            tensors, grads = [outputs * (self.loss_scale / (steps * self.strategy.loss_divisor))], [None]
        else:
            tensors, received = self.channel.recv_grads(outputs)
            grads = list(received)
        started = time.perf_counter()
        self.strategy.start_backward(False)  # accumulate only: reduced once, after the last micro-batch
        if tensors:
            torch.autograd.backward(tensors, grads)
        self.strategy.finish_backward()
        self.timing.compute += time.perf_counter() - started
        if not module.is_first_stage:
            self.channel.send_grads(inputs)

    def _mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The mean over micro-batches and replicas, from the last stage to every rank."""
        value = torch.zeros((), dtype=torch.float32, device=self.channel.device)  # NCCL broadcasts CUDA tensors only
        if self.module.is_last_stage:
            value = torch.stack(losses).mean()
            self.groups.data.all_reduce(value)
            value /= self.groups.data.world_size
        self.groups.pipe.broadcast(value, src=self.module.num_stages - 1)
        return value

    # ------------------------------------------------------------ whole-model state
    @collective("full_state_dict")
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full-precision weights of every stage on global rank 0, in ``to_sequential()``'s order
        (``{}`` elsewhere); collective over all ranks."""
        stage_state = super().full_state_dict()  # on each stage's first replica
        if self.groups.replica != 0:
            return {}
        merged = gather_to_first(self.groups.p2p, self.groups.pipe, stage_state, self.channel.device)
        return {name: merged[name] for name in global_order([list(merged)], self.module.tied_keys)}

    @collective("save_16bit_model")
    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """Every stage's weights in the compute dtype, in one file written by global rank 0 (collective)."""
        state = self.state_dict_16bit()
        if self.global_rank == 0:
            save_state_dict(state, Path(save_dir) / save_filename)
        return True

    def checkpointable(self) -> PipelineState:
        """The whole pipeline as the checkpoint layer sees it: every rank, global names
        (``engine.save_checkpoint``/``load_checkpoint`` go through it)."""
        return PipelineState(self, self.module, self.groups, self.ties)

    def __repr__(self) -> str:
        module = self.module
        return (
            f"PipelineEngine(stage={module.stage_id}/{module.num_stages}, replicas={self.groups.topology.replicas}, "
            f"zero={self.strategy.stage}, dtype={self.precision.dtype})")


def _check_pipeline_config(module: PipelineModule, config: Config, process_group: Any) -> None:
    stage = config.zero_optimization.stage
    if stage >= 2:
        raise ValueError(
            f"`zero_optimization.stage` {stage} with a {module.num_stages}-stage pipeline: ZeRO-2/3 shard gradients"
            f"{' and parameters' if stage == 3 else ''} across replicas at every backward, which a pipeline's "
            "micro-batch backwards cannot do (DeepSpeed refuses it too). Use stage 0 or 1 with the pipeline, or "
            "train the same layers as one module at ZeRO-2/3: `PipelineModule(layers, num_stages=1).to_sequential()`")
    if process_group is not None:
        raise ValueError(
            "`process_group` was passed with a multi-stage PipelineModule: a pipeline spans the default process "
            "group it was built in (stages × replicas); leave `process_group` out")


def _agree_on_construction(module: PipelineModule, config: Config, name: Optional[str]) -> None:
    """Every rank builds this same pipeline engine as its next one, before the world-wide group creation (ranks that
    disagree get an error naming the difference instead of a hang). Across stages only the config must be equal (each
    stage holds other layers, with its own optimizer); a stage's ranks compare those when its engine is built.
    """
    world = Comm(None)
    if not world.distributed:
        return
    fingerprints = {"config": config_fingerprint(config)}
    payload = {"op": "initialize", "name": name, "stage": config.zero_optimization.stage,
               "pipeline": [module.num_stages, module.num_layers, module.parts],
               "fingerprints": digests(fingerprints)}
    session = join(world, "initialize", payload, config.checkpoint.timeout)
    fix = ("every rank must build the same engines in the same order: the k-th `shardwise.initialize` of each "
           "rank wraps the same PipelineModule (same layers, num_stages, partition) with the same config")
    for key, what in (("op", "collective calls"), ("name", "engine names"), ("stage", "ZeRO stages"),
                      ("pipeline", "pipelines (stages, layers, boundaries)")):
        session.require_same(key, what, fix)
    label = f"pipeline engine `{name}`" if name else f"pipeline engine ({module.num_stages} stages)"
    require_same_construction(session, fingerprints, label)


def _draw(data_iter: Any, steps: int, batch: _Batch) -> tuple[Optional[int], str]:
    """Pull ``steps`` micro-batches; ``(count, "")``, or ``(None, why)`` for a malformed one."""
    for index in range(steps):
        try:
            item = next(data_iter)
        except StopIteration:
            return index, ""
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            return None, f"micro-batch {index} is a `{type(item).__name__}`, not an `(inputs, labels)` pair"
        batch.append((item[0], item[1]))
    return steps, ""


def _data_error(call: str, steps: int, short: dict[int, int], rank: int, problem: Optional[str]) -> str:
    if problem:
        return f"rank {rank}: `engine.{call}`: data_iter's {problem}; yield `(inputs, labels)` tuples"
    detail = ", ".join(f"rank {r}: {'a malformed item' if c < 0 else f'{c} of {steps}'}" for r, c in short.items())
    return (
        f"rank {rank}: `engine.{call}` needs {steps} micro-batches (`gradient_accumulation_steps`) from data_iter on "
        f"the first and last stage, but data_iter ran out mid-batch ({detail}); nothing was trained. Give every "
        f"rank the same number of micro-batches, a multiple of {steps}, or stop when it runs out")
