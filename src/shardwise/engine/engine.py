"""The Engine: the user-facing training loop around a model.

It owns the counters, accumulation and the precision policy, and delegates everything about *where* tensors
live to a ZeRO strategy: it knows no stage internals.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Any, Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from ..comm.agreement import join
from ..comm.construction import digests, engine_fingerprints, require_same_construction
from ..comm.distributed import Comm
from ..config import Config
from ..faults import control
from ..faults.announce import WHAT, Announcer, code, register
from ..faults.ledger import ACTIVITY, doing, failed
from ..optim.hardware import warn_if_slow_bf16
from ..optim.optimizers import resolve_optimizer
from ..optim.precision import Precision, ZeroOptimizer
from ..optim.schedulers import build_scheduler
from ..zero import make_strategy
from ..zero.stage3.params import is_partitioned
from . import ownership
from .checks import check_loss, check_model, check_trainable
from .compile import compile_module, is_compiled_module
from .getters import DeepSpeedGetters
from .weights import WeightsSurface

__all__ = ["Engine"]

logger = logging.getLogger("shardwise")


class Engine(DeepSpeedGetters, WeightsSurface):
    """A model wrapped for data-parallel training; build it with :func:`shardwise.initialize`.

    ``engine(batch)`` runs the forward, ``engine.backward(loss)`` the scaled, accumulation-aware backward, and
    ``engine.step()`` the optimizer update at accumulation boundaries.  Any attribute the engine lacks resolves on
    the wrapped module, so ``engine.generate(...)`` calls the model's own method.
    """

    def __init__(
        self,
        module: nn.Module,
        config: Config,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        model_parameters: Any = None,
        process_group: Optional[dist.ProcessGroup] = None,
        name: Optional[str] = None,
    ) -> None:
        if config.seed is not None:
            torch.manual_seed(config.seed)
        self.module = module
        self.config = config
        #: the engine's name (``initialize(..., name=...)``); names its checkpoints among several engines
        self.name = name
        self.comm = Comm(process_group, timeout=config.comms.timeout, debug=config.comms.debug)
        self._label = f"engine `{name}`" if name else \
            f"engine (stage {config.zero_optimization.stage}, {type(module).__name__})"
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        #: what announces this engine's collective operations to the other ranks (:mod:`.faults.announce`)
        self._announcer = Announcer(self.comm, self._label, self._counters)
        #: ``backward`` and ``step`` (on every gradient's path): records, codes and scopes made once (:meth:`_running`)
        self._calls = {phase: doing(phase, self._label) for phase in ("backward", "step")}
        self._codes = {phase: code(phase) for phase in self._calls}
        self._scopes = {phase: self._announcer.scope(phase) for phase in self._calls}
        #: a `backward` (or `step`) that raised partway, what it raised: training refuses to go on until
        #: `zero_grad()` (after a step: `load_checkpoint`) says how to recover (docs/faults.md)
        self._failed_backward: Optional[str] = None
        self._failed_step: Optional[str] = None
        with doing("initialize", self._label):
            check_model(module, self.comm.rank)
            ownership.claim(module.named_parameters(), self, self.comm.rank)
            with self._announcer.scope("initialize"):
                self._set_up(module, config, optimizer, lr_scheduler, model_parameters)

    def _set_up(self, module: nn.Module, config: Config, optimizer: Any, lr_scheduler: Any,
               model_parameters: Any) -> None:
        """Everything ``__init__`` sets up once the ranks agreed to build this engine."""
        # a list: the agreement reads it, and so does the optimizer (a generator could be read only once)
        model_parameters = None if model_parameters is None else list(model_parameters)
        self._agree_on_construction(optimizer, lr_scheduler, model_parameters)
        if config.comms.shared_memory:
            self.comm.open_shared_memory()
        self._timers: dict[str, float] = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self.batch_sizes = config.batch_sizes(self.comm.world_size)
        self.precision = Precision.from_config(config)
        self._step_applied = False
        self._in_no_sync = False
        #: backward calls since the last `step()`/`zero_grad()`, and whether one reduced (a boundary)
        self._backwards = 0
        self._reduced = False
        #: backward calls accumulated since the last optimizer step (what the step check compares)
        self._accumulated = 0
        #: DeepSpeed's dialect sets this: several backwards before one step add up (as DeepSpeed's do)
        #: instead of being refused; each still reduces while autograd runs (see `_backward_pass`)
        self.accumulates_backwards = False
        self._prepare_module()
        self._broadcasts_buffers = config.broadcast_buffers and self.comm.distributed
        first = next(iter(module.parameters()), None)
        warn_if_slow_bf16(self.precision.dtype, first.device if first is not None else torch.device("cpu"),
                          self.comm.rank)
        params = list(model_parameters) if model_parameters is not None else list(module.parameters())
        check_trainable(module, params, optimizer is not None or config.optimizer is not None, self.comm.rank)
        inner = resolve_optimizer(optimizer, config, params)
        self.strategy = make_strategy(module, self.comm, self.precision, config.zero_optimization)
        self.strategy.attach(inner, self._initial_values)
        self.strategy.attach_announcer(self._announcer)
        reduction = self.strategy.describe_reduction()
        if reduction is not None and self.comm.distributed and self.comm.rank == 0:
            logger.info("%s: %s; collectives through %s", self._label, reduction, self.comm.transport)
        del self._initial_values
        self.optimizer: Optional[ZeroOptimizer] = None
        if inner is not None:
            self.optimizer = ZeroOptimizer(inner, self.strategy, self.precision, self.comm, config.gradient_clipping)
        self.lr_scheduler = self._make_scheduler(lr_scheduler)

    def _counters(self) -> tuple[int, int]:
        """What announcements carry of this engine's position: ``(global_steps, micro_steps)``."""
        return self.global_steps, self.micro_steps

    # ------------------------------------------------------------- set-up
    def _agree_on_construction(self, optimizer: Any, lr_scheduler: Any, model_parameters: Optional[list[Any]]) -> None:
        """Every rank of the group builds this same engine as its next one (before any collective), or the c10d store
        names the mismatch within ``checkpoint.timeout`` (:mod:`shardwise.comm.construction`; why: docs/faults.md,
        "Ranks that build different engines")."""
        if not self.comm.distributed:
            return
        fingerprints = engine_fingerprints(self.module, self.config, optimizer, lr_scheduler, model_parameters)
        payload = {"op": "initialize", "name": self.name, "fingerprints": digests(fingerprints)}
        session = join(self.comm, "initialize", payload, self.config.checkpoint.timeout)
        fix = ("every rank must build the same engines in the same order: the k-th `shardwise.initialize` "
               "of each rank wraps the same model with the same config")
        session.require_same("op", "collective calls", fix)
        session.require_same("name", "engine names", fix)
        require_same_construction(session, fingerprints, self._label)

    def _prepare_module(self) -> None:
        """Move to the process group's device, cast, and make all ranks start identical."""
        backend = dist.get_backend(self.comm.group) if self.comm.distributed or dist.is_initialized() else "gloo"
        if backend == "nccl" and not any(p.is_cuda for p in self.module.parameters()):
            self.module.to(torch.device("cuda", torch.cuda.current_device()))
        if self.comm.distributed:
            # Parameters `zero.Init` partitioned were already broadcast from rank 0 when partitioned.
            params = [p for p in {id(p): p for p in self.module.parameters()}.values() if not is_partitioned(p)]
            self._broadcast_from_rank0([p.data for p in params] + list(self.module.buffers()), "parameters and buffers")
        # Keep the fp32 values so master weights start exact, not rounded to bf16/fp16.
        self._initial_values = {id(p): p.data for p in self.module.parameters() if not is_partitioned(p)}
        if self.precision.low_precision:
            self.module.to(self.precision.dtype)

    def _broadcast_from_rank0(self, tensors: list[torch.Tensor], label: str) -> None:
        """Give every rank rank 0's values of ``tensors``: one broadcast per dtype."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in tensors:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        for group in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            self.comm.broadcast(flat, src=0, label=label)
            for tensor, value in zip(group, torch._utils._unflatten_dense_tensors(flat, group)):
                tensor.copy_(value)

    def _buffers_to_sync(self) -> list[torch.Tensor]:
        """What :meth:`_sync_buffers` broadcasts in this forward (looked up each time: a model may replace them)."""
        if not (self._broadcasts_buffers and torch.is_grad_enabled() and not self._in_no_sync):
            return []
        return list(self.module.buffers())

    def _sync_buffers(self, buffers: Optional[list[torch.Tensor]] = None) -> None:
        """Before a training forward (not inside ``no_sync`` or without grad): rank 0's buffers on every rank, as DDP's
        ``broadcast_buffers=True`` (why: docs/zero.md, "Buffers follow rank 0")."""
        buffers = self._buffers_to_sync() if buffers is None else buffers
        if buffers:
            self._broadcast_from_rank0(buffers, "buffers")

    def _make_scheduler(self, lr_scheduler: Any) -> Any:
        if lr_scheduler is not None and self.config.scheduler is not None:
            raise ValueError(
                "an lr_scheduler was passed to `shardwise.initialize` and the config has a `scheduler` "
                "section; keep one of them"
            )
        if self.config.scheduler is not None:
            self._require_optimizer("a `scheduler` in the config")
            return build_scheduler(self.config.scheduler, self.optimizer)
        if lr_scheduler is None or hasattr(lr_scheduler, "step"):
            return lr_scheduler
        if callable(lr_scheduler):
            self._require_optimizer("an lr_scheduler callable")
            return lr_scheduler(self.optimizer)
        raise TypeError(
            f"lr_scheduler of type `{type(lr_scheduler).__name__}` has no `step()` and is not callable; "
            "pass a scheduler object or a callable `optimizer -> scheduler`"
        )

    def _require_optimizer(self, what: str) -> ZeroOptimizer:
        if self.optimizer is None:  # an inference-only engine
            raise RuntimeError(
                f"{what} needs an optimizer, but this engine is inference-only: pass `optimizer=` to "
                "`shardwise.initialize` or add an `optimizer` section to the config"
            )
        return self.optimizer

    # ------------------------------------------------------------ training
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module (floating inputs cast to the compute dtype)."""
        if self.config.auto_refresh_trainable and self.strategy.trainable_changed():
            self.refresh_trainable()
        args, kwargs = self.precision.cast_inputs((args, kwargs))
        with doing("forward", self._label), self._timed("forward"):
            self._require_clean("`engine(...)` (forward)", after_backward=False)
            buffers = self._buffers_to_sync()
            # announced where it moves data: stage 3 gathers, a buffer broadcast (a forward of the flat stages
            # moves none, and a failure in it still counts: it started)
            operation = "forward" if torch.is_grad_enabled() else "`forward` without grad"
            with self._announcer.scope(operation, bool(buffers) or self.strategy.gathers):
                self._sync_buffers(buffers)
                try:
                    return self.module(*args, **kwargs)
                except BaseException:
                    self.strategy.abort_forward()
                    raise

    __call__ = forward

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``step()`` applies the optimizer."""
        return (self.micro_steps + 1) % self.batch_sizes.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """Backward of ``loss`` scaled for fp16 and divided by the accumulation steps.

        Gradients are reduced across ranks only at an accumulation boundary and outside :meth:`no_sync`.
        """
        with self._running("backward") as call:
            self._require_optimizer("`engine.backward`")
            self._require_clean("`engine.backward`")
            sync = self.is_gradient_accumulation_boundary() and not self._in_no_sync
            self._check_backward(loss, sync)
            # One scalar multiply covers loss scaling, accumulation averaging and
            # (for strategies that sum) the average over ranks.
            accumulation = self.batch_sizes.gradient_accumulation_steps
            scale = self.precision.scaler.current / (accumulation * self.strategy.loss_divisor)
            # announced where it moves data: a reducing backward, or any at stage 3 (it re-gathers)
            with self._announced(call, "backward", sync or self.strategy.gathers), self._timed("backward"):
                self._backward_pass(loss * scale if scale != 1.0 else loss, sync, retain_graph)
            self._backwards += 1
            self._accumulated += 1
            self._reduced = self._reduced or sync
            # (counted only when no gradient arrived: not on the path of every backward)
            if self.strategy.backward.arrivals == 0 and (trained := self.strategy.trained_count()):
                raise RuntimeError(
                    f"rank {self.comm.rank}: the loss passed to `backward` of {self.label} reached none of its "
                    f"{trained} trainable parameter(s); most likely it was computed by another engine (call that "
                    "engine's `backward`), or without this engine's model"
                )
            return loss

    def _backward_pass(self, tensor: torch.Tensor, sync: bool, retain_graph: bool) -> None:
        """Autograd, run by the strategy: its hooks reduce (``sync``) or accumulate.

        A second backward at the same boundary (DeepSpeed's dialect) keeps what the first one reduced
        aside and adds it to what this one reduces: the same as one backward of the summed losses, with
        the reduction still overlapping autograd.
        """
        again = sync and self._reduced
        with self.strategy.adding_to_reduced() if again else contextlib.nullcontext():
            try:
                self.strategy.run_backward(tensor, sync, retain_graph)
            except BaseException as exc:
                # Autograd raised partway (a hook, an interrupt): the strategy waited for and dropped the reductions
                # already launched, and training refuses to go on until `zero_grad()` drops the partial gradients.
                self._failed_backward = f"{type(exc).__name__}: {exc}"[:300]
                raise

    @contextlib.contextmanager
    def _running(self, phase: str) -> Iterator[doing]:
        """``with doing(...)`` (:mod:`shardwise.faults.ledger`) inline, around ``backward`` and ``step``: the call's
        record is made once, at initialize, so that every gradient's path leaves this file only when it fails."""
        call = self._calls[phase]
        call.started = False
        ACTIVITY.append(call)
        try:
            yield call
        except BaseException as exc:
            if ACTIVITY and ACTIVITY[-1] is call:
                ACTIVITY.pop()
            failed(call, exc)
            raise
        if ACTIVITY and ACTIVITY[-1] is call:
            ACTIVITY.pop()

    @contextlib.contextmanager
    def _announced(self, call: doing, operation: str, announce: bool) -> Iterator[None]:
        """An announced :class:`~shardwise.faults.announce.Scope` inline, around ``backward`` and ``step`` (the
        shared form would add its file to every gradient's path): with more than one rank and no operation
        covering the group, ``announce`` it (one :meth:`~shardwise.comm.distributed.Comm.agree`) and cover the
        group for its length; from then on the call has started (a failure counts)."""
        comm = self.comm
        ledger = comm.ledger
        if not comm.distributed or ledger.scope is not None:
            call.started = True
            yield
            return
        if announce:
            steps, micro = self.global_steps, self.micro_steps
            comm.agree([control.ANNOUNCE, self._codes[operation], self._announcer.index, steps, micro],
                       control.ANNOUNCED, WHAT.format(operation=f"`{operation}`", owner=self._label, detail="",
                                                      steps=steps, micro=micro))
        scope = ledger.scope = self._scopes[operation]
        call.started = True
        try:
            yield
        finally:
            if ledger.scope is scope:
                ledger.scope = None

    def _require_clean(self, call: str, after_backward: bool = True) -> None:
        """Refuse ``call`` while a ``step`` (or, with ``after_backward``, a ``backward``) that raised partway left
        state behind, saying how to recover (docs/faults.md: an exception caught mid-step)."""
        if self._failed_step is not None:
            raise RuntimeError(
                f"rank {self.comm.rank}: {call} refused: the last `engine.step()` of {self.label} raised "
                f"(`{self._failed_step}`) after the ranks had agreed on it, so this rank's weights or optimizer state "
                "may be partly updated; restore them on every rank with `engine.load_checkpoint(...)` (with optimizer "
                "state offloaded to NVMe: build a new engine and load it) before training or evaluating on"
            )
        if after_backward and self._failed_backward is not None:
            raise RuntimeError(
                f"rank {self.comm.rank}: {call} refused: the last `engine.backward` of {self.label} raised partway "
                f"(`{self._failed_backward}`), so the gradients hold part of its micro-batch; call "
                "`engine.zero_grad()` on every rank (it drops them, with the rest of this step's accumulation), "
                "then go on"
            )

    def _check_backward(self, loss: Any, sync: bool) -> None:
        """What `backward` refuses before touching anything (so a refused call leaves no half-reduced state)."""
        if not (isinstance(loss, torch.Tensor) and loss.requires_grad and loss.numel() == 1 and loss.is_floating_point()):
            check_loss(loss, self.comm.rank, self.label)  # names what is wrong
        if sync and self._reduced and not self.accumulates_backwards:
            raise RuntimeError(
                f"rank {self.comm.rank}: `engine.backward` was called again at an accumulation boundary without "
                f"`engine.step()` in between ({self.label}, micro-step {self.micro_steps}); the first call already "
                "reduced the gradients across ranks, a second would reduce them again. Sum the losses and call "
                "`backward` once (`engine.backward(loss_a + loss_b)`), or call `engine.step()` after each backward"
            )

    @property
    def label(self) -> str:
        """How messages name this engine: ``engine `student` `` or ``engine (stage 2, Net)``."""
        return self._label

    def step(self) -> bool:
        """Apply the optimizer at an accumulation boundary; True if an update was applied."""
        with self._running("step") as call:
            return self._step(call)

    def _step(self, call: doing) -> bool:
        optimizer = self._require_optimizer("`engine.step`")
        self._require_clean("`engine.step()`")
        if self._in_no_sync:
            raise RuntimeError(
                "`engine.step()` was called inside `engine.no_sync()`: gradients there are not "
                "synchronised across ranks; leave the `no_sync` block and run one backward outside it first"
            )
        if self._backwards == 0:
            raise RuntimeError(
                f"rank {self.comm.rank}: `engine.step()` was called with no `engine.backward(loss)` since the last "
                f"step ({self.label}, micro-step {self.micro_steps}); every step applies (or accumulates) the "
                "gradients of at least one backward: call `engine.backward(loss)` first"
            )
        applied = False
        if self.is_gradient_accumulation_boundary():
            # Before the update: ranks whose collectives paired up wrongly must not apply what they reduced.
            # The step check is the step's agreement: the scope only covers what the step issues.
            self.comm.check(f"`step` of {self._label}", [self.global_steps, self.micro_steps, self._accumulated],
                            ["global_steps", "micro_steps", "backwards accumulated"])
            self._accumulated = 0
            with self._announced(call, "step", False), self._timed("step"):
                try:
                    applied = optimizer.step(zero_grad=True)  # the update, then the gradients dropped: one call
                except BaseException as exc:
                    self._failed_step = f"{type(exc).__name__}: {exc}"[:300]
                    raise
                self._step_applied = applied
                if applied:
                    if self.lr_scheduler is not None:
                        self.lr_scheduler.step()
                else:
                    self.skipped_steps += 1
                self.global_steps += 1
            self._report()
        self.micro_steps += 1
        self._backwards = 0
        self._reduced = False
        return applied

    @contextlib.contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        if not self.config.wall_clock_breakdown:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self._timers[phase] += time.perf_counter() - start

    def _report(self) -> None:
        """Every ``steps_per_print`` steps, log lr, loss scale and grad norm (and timings)."""
        if self.global_steps % self.config.steps_per_print or self.comm.rank != 0:
            return
        who = f"{self.name} " if self.name else ""  # several engines print side by side
        line = (
            f"{who}step {self.global_steps}: lr={', '.join(f'{lr:.3g}' for lr in self.get_lr())} loss_scale={self.loss_scale:g} "
            f"grad_norm={self.get_global_grad_norm() or 0.0:.4g} skipped={self.skipped_steps}"
        )
        if self.config.wall_clock_breakdown:
            line += " " + " ".join(f"{k}={v * 1e3:.1f}ms" for k, v in self._timers.items())
            self._timers = dict.fromkeys(self._timers, 0.0)
        logger.info(line)

    def zero_grad(self) -> None:
        """Drop all gradients, reduced or not (the next step needs a new backward); after a ``backward`` that
        raised partway, also what it left in flight, so training can go on."""
        self.strategy.zero_grad()
        self._backwards = 0
        self._reduced = False
        self._accumulated = 0
        self._failed_backward = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward accumulates gradients locally with no communication."""
        previous, self._in_no_sync = self._in_no_sync, True
        try:
            yield
        finally:
            self._in_no_sync = previous

    def refresh_trainable(self) -> None:
        """Rebuild buckets and partitions after ``requires_grad`` changed."""
        if self.strategy.has_pending_grads():
            raise RuntimeError(
                f"rank {self.comm.rank}: the set of trainable parameters changed while gradients were "
                "accumulated but not yet applied (mid-accumulation or under `no_sync`); finish the "
                "accumulation with `engine.step()` before changing `requires_grad`"
            )
        with doing("refresh_trainable", self._label), self._announcer.scope("refresh_trainable"):
            self.strategy.refresh_trainable()

    # ------------------------------------------------------------ lr, scale
    def get_lr(self) -> list[float]:
        """The learning rate of each param group."""
        return [float(g["lr"]) for g in self._require_optimizer("`get_lr`").param_groups]

    def set_lr(self, lr: Union[float, list[float]]) -> None:
        """Set one lr for all param groups, or one per group."""
        groups = self._require_optimizer("`set_lr`").param_groups
        values = lr if isinstance(lr, (list, tuple)) else [lr] * len(groups)
        if len(values) != len(groups):
            raise ValueError(f"set_lr got {len(values)} values for {len(groups)} param groups; pass one per group or a single float")
        for group, value in zip(groups, values):
            group["lr"] = value

    @property
    def loss_scale(self) -> float:
        return self.precision.scaler.current

    def override_loss_scale(self, scale: Optional[float]) -> None:
        """Fix the loss scale from the next backward on; None returns to dynamic scaling."""
        if scale is not None and not scale > 0:
            raise ValueError(f"override_loss_scale({scale!r}): the scale must be > 0, or None for dynamic scaling")
        self.precision.scaler.override = None if scale is None else float(scale)

    # ------------------------------------------------------------- compile
    def compile(
        self,
        backend: Any = "inductor",
        compile_kwargs: Optional[dict[str, Any]] = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """``torch.compile`` the wrapped module in place, as DeepSpeed's ``engine.compile``; later forwards
        run compiled.  Nothing happens when it already runs compiled (see :attr:`is_compiled`)."""
        if self.is_compiled:
            return
        compile_module(self.module, backend, compile_kwargs, schedule, compiled_autograd_enabled, self.comm.rank)

    @property
    def is_compiled(self) -> bool:
        """Whether the wrapped module runs compiled (``engine.compile()``, or compiled before ``initialize``)."""
        return is_compiled_module(self.module)

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    def destroy(self, restore_params: bool = True) -> None:
        """Remove every hook shardwise put on the module, and let go of its parameters.

        At stage 3 the parameters get their full values back, gathered onto every rank (collective), so the module
        is a plain module again. ``restore_params=False`` leaves each of its parameters empty (0 elements, the
        persistent ones too) instead, and gathers nothing: for a model that is dropped next and that no rank could
        hold whole (one trained with ``offload_param``). Other stages hold full parameters already and ignore it."""
        with doing("destroy", self._label), self._announcer.scope("destroy", self.strategy.gathers and restore_params):
            self.strategy.close(restore_params)
        self.comm.close_shared_memory()
        ownership.release(self.module.parameters(), self)

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: pass through to the wrapped module.
        if name == "module" or "module" not in self.__dict__:
            raise AttributeError(name)
        module = self.__dict__["module"]
        try:
            found = getattr(module, name)
        except AttributeError:
            raise AttributeError(
                f"neither `{type(self).__name__}` nor the wrapped module `{type(module).__name__}` "
                f"has an attribute `{name}`"
            ) from None
        if name == "generate" and callable(found):
            return functools.partial(self._generate, found)
        return found

    def _generate(self, generate: Any, *args: Any, **kwargs: Any) -> Any:
        """``engine.generate(...)``: the model's own ``generate``, run as an engine call (at stage 3 each of its
        forward passes announces itself as one of ``generate``: ranks that stop at different lengths are caught
        at the first pass one rank runs alone)."""
        with doing("generate", self._label):
            # no scope of its own: each pass announces (and from then on a failure counts), or, at stages 0-2,
            # moves nothing
            self._require_clean("`engine.generate`", after_backward=False)
            return generate(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Engine(stage={self.strategy.stage}, dtype={self.precision.dtype}, module={type(self.module).__name__})"


for _operation in ("forward", "backward", "step", "destroy", "refresh_trainable", "generate"):
    register(f"Engine.{_operation}", _operation)
register("Engine.__init__", "initialize")


