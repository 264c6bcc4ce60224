"""The interface every ZeRO stage implements.

The engine and :class:`~shardwise.zero.optimizer.ZeroOptimizer` know only this
interface; what a stage keeps where (replicated, sharded, gathered on demand) is
the stage's business.  The step pipeline is the same for all stages:

``start_backward(sync)`` → autograd (the stage's hooks reduce gradients when
``sync``) → ``finish_backward()`` → ``grad_sq()`` (local) → [all-reduce if
``shards_grads``] → overflow check, unscale and clip via ``scale_grads`` →
inner optimizer step over ``master`` pieces → ``after_step()`` (master → model
parameters) → ``zero_grad()``.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch import nn

from ..distributed import Comm
from ..precision import Precision

__all__ = ["ParamShard", "Strategy", "module_order", "tensor_bytes"]


@dataclass
class ParamShard:
    """The part of one trainable parameter this rank owns, for checkpoints.

    ``master`` is the writable fp32 1-D view of elements ``[start, end)`` of the
    flattened parameter; ``key`` is the tensor the inner optimizer's ``state``
    and ``param_groups`` use for it (so ``inner.state[key]`` holds its
    optimizer state, whose tensors have ``end - start`` elements); ``group``
    is its param-group index.
    """

    name: str
    shape: torch.Size
    start: int
    end: int
    master: torch.Tensor
    key: torch.Tensor
    group: int
    extra: dict[str, Any] = field(default_factory=dict)


def tensor_bytes(tensors: Any) -> int:
    """Storage bytes of the tensors in a (nested) container, each counted once."""
    seen: set[int] = set()
    total = 0
    stack = [tensors]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if id(item) not in seen:
                seen.add(id(item))
                total += item.numel() * item.element_size()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def module_order(module: nn.Module, groups: list[list[nn.Parameter]]) -> list[nn.Parameter]:
    """The optimizer's parameters in module registration order (checked to belong to the model)."""
    in_groups = {id(p): p for group in groups for p in group}
    order = [p for p in module.parameters() if id(p) in in_groups]
    if len(order) != len(in_groups):
        known = {id(p) for p in module.parameters()}
        stray = [tuple(p.shape) for p in in_groups.values() if id(p) not in known]
        raise ValueError(
            f"the optimizer holds {len(stray)} tensor(s) that are not parameters of the model "
            f"(shapes {stray[:5]}); build the optimizer from `model.parameters()` of the model "
            "passed to `shardwise.initialize`"
        )
    return order


class Strategy(ABC):
    """One ZeRO stage: where parameters, gradients and master weights live."""

    stage: int = -1
    #: whether ``grad_sq`` is a partial sum that must be all-reduced across ranks
    shards_grads: bool = False
    #: the engine divides the loss by this before backward, so a summing
    #: reduction yields the average with no extra pass over the gradients
    loss_divisor: float = 1.0

    def __init__(self, module: nn.Module, comm: Comm, precision: Precision, zero_config: Any) -> None:
        self.module = module
        self.comm = comm
        self.precision = precision
        self.zero_config = zero_config
        self.inner: Any = None  # the inner optimizer; None for an inference-only engine
        self.sync = False

    def attach(self, inner: Optional[Any], initial: Optional[dict[int, torch.Tensor]] = None) -> None:
        """Take over the inner optimizer's param groups (None: inference only).

        ``initial`` maps ``id(param)`` to its value before the model was cast to
        the compute dtype, so fp32 master weights can start from it.
        """
        self.inner = inner
        self.initial = initial or {}

    @abstractmethod
    def start_backward(self, sync: bool) -> None:
        """Called before autograd runs; ``sync`` says whether to reduce this time."""

    @abstractmethod
    def finish_backward(self) -> None:
        """Called after autograd: flush and wait for gradient reduction."""

    @abstractmethod
    def grad_sq(self) -> torch.Tensor:
        """Sum of squares of this rank's reduced (still loss-scaled) fp32 gradients."""

    @abstractmethod
    def scale_grads(self, factor: float) -> None:
        """Multiply the reduced gradients by ``factor`` (unscale and clip)."""

    @abstractmethod
    def after_step(self) -> None:
        """Copy updated master weights into the model's parameters."""

    @abstractmethod
    def zero_grad(self) -> None:
        """Forget all gradients (reduced and not yet reduced)."""

    @abstractmethod
    def memory_breakdown(self) -> dict[str, int]:
        """Bytes of tensor storage this rank holds, by kind."""

    @abstractmethod
    def full_master_weights(self) -> dict[int, torch.Tensor]:
        """Full fp32 value of every trainable parameter, keyed by ``id(param)`` (collective)."""

    @abstractmethod
    def param_shards(self) -> list[ParamShard]:
        """This rank's pieces of every trainable parameter (empty for inference)."""

    @contextlib.contextmanager
    def checkpoint_view(self, loading: bool, wanted: frozenset[str] = frozenset()) -> Iterator[None]:
        """While open, ``param_shards`` also covers frozen parameters' kept state.

        Saving: frozen parameters that keep master weights or optimizer state
        (to resume when unfrozen) are listed, so a checkpoint carries them.
        Loading: frozen parameters named in ``wanted`` (those the checkpoint has
        optimizer state for) are listed, so that state lands where it is kept
        until they train again.  Collective on exit.
        """
        yield

    def sync_params_from_master(self) -> None:
        """Write master weights into the model's parameters (collective; after loading)."""
        self.after_step()

    def refresh_trainable(self) -> None:
        """Rebuild whatever depends on the set of trainable parameters."""

    def trainable_changed(self) -> bool:
        """Whether ``requires_grad`` flags differ from those the stage was built for."""
        return False

    def has_pending_grads(self) -> bool:
        """Whether gradients were accumulated but not yet reduced and stepped."""
        return False

    def close(self) -> None:
        """Remove hooks and restore anything the stage changed on the module."""
