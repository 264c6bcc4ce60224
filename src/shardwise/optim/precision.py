"""Precision: the compute dtype, the loss scaler that goes with it, and the optimizer step that applies them.

One object owns the dtype and the scaler, with one ``state_dict``, so a checkpoint restores the scale exactly.
fp16 uses DeepSpeed's dynamic scaling rules (``loss_scale`` 0 = dynamic, ``initial_scale_power``,
``loss_scale_window``, ``hysteresis``, ``min_loss_scale``); bf16 and fp32 use a fixed scale of 1 but still
skip a step whose gradients hold an inf or NaN.  :class:`ZeroOptimizer` (``engine.optimizer``) is that step for
every ZeRO stage (overflow check across ranks, unscale, clip, the stage's step, the scaler's update); it knows a
stage only through :class:`Stepping`.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Protocol

import torch

from ..comm.distributed import Comm
from .optimizers import ShardwiseOptimizer

__all__ = ["LossScaler", "Precision", "Stepping", "ZeroOptimizer"]


class LossScaler:
    """Dynamic (or static) loss scale with hysteresis.

    On overflow the scale is halved, unless hysteresis still has credit, in which case only the credit drops.  A
    clean step that follows ``window`` clean steps since the last overflow (or the start) doubles the scale and
    restores the credit; so does every ``window``-th clean step after that: DeepSpeed's rule (0.19's
    ``stable_interval``; with window 2 and no overflow the scale doubles after steps 2, 4, 6, not 1, 3, 5).
    """

    def __init__(self, initial_scale: float = 2.0**16, dynamic: bool = True, window: int = 1000, hysteresis: int = 2,
                 min_scale: float = 1.0, consecutive_hysteresis: bool = False, factor: float = 2.0) -> None:
        #: the scale the next backward uses: ``override`` when set, else ``scale`` (an attribute, not a property:
        #: every backward and step reads it, and its setters keep it current)
        self.current = float(initial_scale)
        self._scale: Optional[float] = None  # (both set just below)
        self._override: Optional[float] = None
        self.scale = float(initial_scale)
        self.dynamic, self.window, self.hysteresis, self.min_scale = dynamic, window, hysteresis, min_scale
        self.consecutive_hysteresis, self.factor = consecutive_hysteresis, factor
        self.credit, self.iteration, self.last_overflow = hysteresis, 0, -1
        self.override = None

    @property
    def scale(self) -> float:
        """The dynamic (or static) scale."""
        assert self._scale is not None
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        self._scale = value
        self.current = self._override if self._override is not None else value

    @property
    def override(self) -> Optional[float]:
        """A scale fixed by ``engine.override_loss_scale`` (None: the dynamic one)."""
        return self._override

    @override.setter
    def override(self, value: Optional[float]) -> None:
        self._override = value
        self.current = value if value is not None else self.scale

    def update(self, overflow: bool) -> None:
        """Account one optimizer step (applied, or skipped for ``overflow``)."""
        if self.dynamic and self.override is None:
            if overflow:
                if self.credit <= 1:
                    self.scale = max(self.scale / self.factor, self.min_scale)
                else:
                    self.credit -= 1
                self.last_overflow = self.iteration
            else:
                if self.consecutive_hysteresis:
                    self.credit = self.hysteresis
                # DeepSpeed counts the clean steps before this one, so the first doubling comes one step later
                # than `(iteration - last_overflow) % window` would put it.
                stable = self.iteration - self.last_overflow - 1
                if stable > 0 and stable % self.window == 0:
                    self.credit = self.hysteresis
                    self.scale *= self.factor
        self.iteration += 1

    def state_dict(self) -> dict[str, Any]:
        keys = ("scale", "credit", "iteration", "last_overflow", "override", "dynamic")
        return {k: getattr(self, k) for k in keys}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


_REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """The compute dtype of the model and its loss scaler.

    The module computes in ``dtype``; the optimizer always updates fp32 master weights (the strategies keep them).
    Gradients travel between ranks in ``reduce_dtype`` (fp32 unless ``communication_data_type`` says bf16/fp16) and
    are averaged into fp32.
    """

    def __init__(self, dtype: torch.dtype, scaler: LossScaler, reduce_dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self.scaler = scaler
        self.reduce_dtype = reduce_dtype

    @classmethod
    def from_config(cls, config: Any) -> "Precision":
        """Build from a :class:`shardwise.Config` (``fp16`` / ``bf16`` sections, ``communication_data_type``)."""
        reduce_dtype = _REDUCE_DTYPES[config.communication_data_type or "fp32"]
        fp16 = config.fp16
        if fp16.enabled:
            dynamic = fp16.loss_scale == 0
            initial = 2.0**fp16.initial_scale_power if dynamic else fp16.loss_scale
            scaler = LossScaler(initial, dynamic, fp16.loss_scale_window, fp16.hysteresis, fp16.min_loss_scale,
                                fp16.consecutive_hysteresis)
            return cls(torch.float16, scaler, reduce_dtype)
        dtype = torch.bfloat16 if config.bf16.enabled else torch.float32
        return cls(dtype, LossScaler(initial_scale=1.0, dynamic=False), reduce_dtype)

    @property
    def low_precision(self) -> bool:
        return self.dtype != torch.float32

    def cast_inputs(self, value: Any) -> Any:
        """Cast floating-point tensors in a nested structure to the compute dtype."""
        if not self.low_precision:
            return value
        return _map_tensors(value, lambda t: t.to(self.dtype) if t.is_floating_point() else t)

    def state_dict(self) -> dict[str, Any]:
        return {"dtype": str(self.dtype).replace("torch.", ""), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state["scaler"])


def _map_tensors(value: Any, fn: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        mapped = [_map_tensors(v, fn) for v in value]
        return type(value)(*mapped) if hasattr(value, "_fields") else type(value)(mapped)
    if isinstance(value, dict):
        return type(value)((k, _map_tensors(v, fn)) for k, v in value.items())
    return value


class Stepping(Protocol):
    """What :class:`ZeroOptimizer` asks of a ZeRO stage (:class:`shardwise.zero.base.Strategy` has it all)."""

    #: whether :meth:`step_sums` are partial sums to all-reduce across ranks
    shards_grads: bool

    def step_sums(self) -> torch.Tensor:
        """This rank's terms of what the step sums over the ranks (element 0: the squared gradient norm)."""

    def step(self, inner: Any, factor: float, sums: torch.Tensor, release: bool) -> None:
        """The optimizer step over the stage's masters, the gradients multiplied by ``factor``."""

    def zero_grad(self) -> None:
        """Forget all gradients."""


class ZeroOptimizer(ShardwiseOptimizer):
    """Steps the inner optimizer over the master weights a ZeRO stage keeps.

    One all-reduce (the squared gradient norm, for sharded gradients, with stage 3's "had a gradient" flags
    beside it) serves both clipping and overflow detection: an inf or NaN anywhere makes the global sum
    non-finite on every rank, so all ranks skip the same step.  The strategy is asked twice: for this rank's
    terms of the sums (without a pipeline stage's tied copies counted on another stage:
    ``FlatStrategy.count_elsewhere``), and for the step itself with the factor that unscales and clips.
    """

    def __init__(self, inner: Any, strategy: "Stepping", precision: Precision, comm: Comm, clip: float,
                 model_parallel_comm: Optional[Comm] = None) -> None:
        super().__init__(inner)
        self.strategy = strategy
        self.precision = precision
        self.comm = comm
        self.clip = clip
        #: ranks holding *other* parameters of the same model (pipeline stages): the
        #: squared norm is summed over them too, so clipping and overflow are global
        self.model_parallel_comm = model_parallel_comm
        #: global L2 norm of the (unscaled) gradients at the last step; inf on overflow; None before
        self.last_grad_norm: Optional[float] = None

    def step(self, closure: Optional[Callable[[], Any]] = None, *, zero_grad: bool = False) -> bool:  # type: ignore[override]
        """Apply the update; returns False when it was skipped for overflow.  ``zero_grad``: the gradients are
        dropped in the same call (``engine.step()``, as DeepSpeed's; a script's own ``optimizer.step()`` keeps
        them, as torch's does)."""
        if closure is not None:
            raise ValueError("closures are not supported: run forward/backward through the engine instead")
        scale = self.precision.scaler.current
        sums = self.strategy.step_sums()
        if self.strategy.shards_grads:
            self.comm.all_reduce(sums)
        if self.model_parallel_comm is not None:
            self.model_parallel_comm.all_reduce(sums[:1])  # the norm only: the rest count this group's ranks
        norm_sq = float(sums[0].item())
        if not math.isfinite(norm_sq):
            self.last_grad_norm = math.inf
            self.precision.scaler.update(overflow=True)
            if zero_grad:
                self.strategy.zero_grad()
            return False
        self.last_grad_norm = math.sqrt(norm_sq) / scale
        factor = 1.0 / scale
        if self.clip > 0:
            # torch.nn.utils.clip_grad_norm_'s rule, so results match it exactly
            factor *= min(1.0, self.clip / (self.last_grad_norm + 1e-6))
        # scale, leave unused alone, step the masters, publish them (and drop the gradients)
        self.strategy.step(self.inner, factor, sums[1:], zero_grad)
        self.precision.scaler.update(overflow=False)
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.strategy.zero_grad()
