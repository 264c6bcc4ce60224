"""The interface every ZeRO stage implements, and the helpers the stages share (hooks that hold their engine weakly, so
a dropped engine is freed).

The engine and :class:`~shardwise.optim.precision.ZeroOptimizer` know only this interface; what a stage keeps where
(replicated, sharded, gathered on demand) is the stage's business.  Every stage steps the same way: ``run_backward``,
then :meth:`Strategy.step_sums`, all-reduced if ``shards_grads``, then the optimizer's overflow check and factor, then
:meth:`Strategy.step` (each method says its part; the whole path is in docs/life-of-a-gradient.md).
``start_backward`` and ``finish_backward`` are each stage's own (no shared ``super()`` part): they are on every
gradient's path, and what they share is three fields of :class:`Backward`.
"""

from __future__ import annotations

import contextlib
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from ..comm.distributed import Comm
from ..engine.ownership import owner_label
from ..optim.param_state import ParamShard
from ..optim.precision import Precision

__all__ = ["Backward", "Strategy", "group_index", "module_order", "remove_with", "tensor_bytes"]

#: what a load applies once every rank has read its part (may be collective)
Apply = Callable[[], None]


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
        strays = [p for p in in_groups.values() if id(p) not in known]
        owners = sorted({label for p in strays if (label := owner_label(p)) is not None})
        whose = f"; they are parameters of {', '.join(owners)}" if owners else ""
        raise ValueError(
            f"the optimizer holds {len(strays)} tensor(s) that are not parameters of the model "
            f"(shapes {[tuple(p.shape) for p in strays[:5]]}){whose}; build the optimizer from "
            "`model.parameters()` of the model passed to `shardwise.initialize`")
    return order


def group_index(groups: list[list[nn.Parameter]]) -> dict[int, int]:
    """Parameter id -> index of its param group."""
    return {id(p): g for g, params in enumerate(groups) for p in params}


def remove_with(owner: object, handles: Iterable[Any]) -> None:
    """Remove the hooks of ``handles`` (torch's removable handles) once ``owner`` is freed.

    The hooks shardwise puts on a model's tensors hold their object (the flat stages' gradient storage, stage
    3's strategy) only weakly, through a ``weakref.ref`` in a ``functools.partial``: torch keeps a tensor's
    hooks in C++, where Python's collector cannot follow a reference, so a hook holding its engine would keep
    the engine, the model and their buffers alive for the life of the process (measured before: 20 stage-3
    engines built and dropped without ``destroy()`` took one rank from 236 to 682 MiB).  Once the object is
    freed its hooks are removed, and a model kept after dropping its engine trains as a plain module does.

    ``handles`` may be a list or dict the caller keeps adding to (a dict: its values are removed); it is held
    here as it is, so the handles added later are removed too, and it must not refer to ``owner``."""
    weakref.finalize(owner, _remove, handles)


def _remove(handles: Iterable[Any]) -> None:
    for handle in list(handles.values() if isinstance(handles, dict) else handles):
        handle.remove()


@dataclass
class Backward:
    """What one engine's current backward is doing: written by the stage's ``start_backward`` and ``finish_backward``,
    read by its gradient hooks (which may live on another object: the flat stages' gradient storage)."""

    #: whether this backward reduces (an accumulation boundary outside ``no_sync``)
    sync: bool = False
    #: between this engine's start_backward and finish_backward (another engine's backward
    #: can reach this model's parameters: a GAN's generator loss flows through the discriminator)
    active: bool = False
    #: gradients of this engine's trainable parameters produced by its current backward
    arrivals: int = 0
    #: counts this engine's backwards: per-backward state elsewhere is reset when it changes
    serial: int = 0


class Strategy(ABC):
    """One ZeRO stage: where parameters, gradients and master weights live."""

    stage: int = -1
    #: whether ``step_sums`` are partial sums that must be all-reduced across ranks
    shards_grads: bool = False
    #: the engine divides the loss by this before backward, so a summing
    #: reduction yields the average with no extra pass over the gradients
    loss_divisor: float = 1.0
    #: whether every forward and backward gathers parameters (collectives even without a reduction): the
    #: engine then announces each of them (:mod:`shardwise.faults.announce`)
    gathers: bool = False

    def __init__(self, module: nn.Module, comm: Comm, precision: Precision, zero_config: Any) -> None:
        self.module, self.comm, self.precision, self.zero_config = module, comm, precision, zero_config
        self.inner: Any = None  # the inner optimizer; None for an inference-only engine
        self.backward = Backward()
        #: the inner optimizer's param groups as the user listed them (``attach`` fills it)
        self._groups: list[list[nn.Parameter]] = []

    def attach(self, inner: Optional[Any], initial: Optional[dict[int, torch.Tensor]] = None) -> None:
        """Take over the inner optimizer's param groups (None: inference only).  ``initial`` maps ``id(param)`` to its
        value before the model was cast to the compute dtype, so fp32 master weights can start from it.
        """
        self.inner = inner
        self.initial = initial or {}

    def group_names(self) -> list[list[str]]:
        """Each param group's parameters by name, in the order the user's optimizer listed them (the order
        a torch optimizer's ``state_dict`` numbers them in)."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        return [[names[id(p)] for p in group] for group in self._groups]

    @abstractmethod
    def run_backward(self, tensor: torch.Tensor, sync: bool, retain_graph: bool = False) -> None:
        """The engine's backward, asked for once: :meth:`start_backward`, autograd of ``tensor`` (already scaled),
        :meth:`finish_backward`; :meth:`abort_backward` when autograd raises.  Each stage's own, so that autograd
        calls the stage's hooks from the stage's file."""

    @abstractmethod
    def start_backward(self, sync: bool) -> None:
        """Called before autograd runs; ``sync`` says whether to reduce this time (sets :attr:`backward`)."""

    @abstractmethod
    def finish_backward(self) -> None:
        """Called after autograd: flush and wait for gradient reduction (``backward.active`` becomes False)."""

    def abort_forward(self) -> None:
        """The engine's forward raised: let go of whatever its module hooks still hold (stage 3)."""

    def abort_backward(self) -> None:
        """Autograd raised between ``start_backward`` and ``finish_backward``: what the backward launched is
        waited for and dropped (a peer that launched it too completes it; one that failed first is named), and
        its hooks stop reducing.  What it accumulated stays until ``zero_grad``, which the engine asks for."""
        self.backward.active = False

    def attach_announcer(self, announcer: Any) -> None:
        """The engine's announcements (:mod:`shardwise.faults.announce`): a stage whose module hooks move data
        (stage 3) announces the passes that do not go through the engine."""

    @abstractmethod
    def step_sums(self) -> torch.Tensor:
        """This rank's terms of what the step sums over the ranks, one new 1-D fp32 tensor: element 0 is the
        sum of squares of its reduced (still loss-scaled) fp32 gradients; any further elements are the
        stage's own counts, summed in the same all-reduce and handed to :meth:`step` (a stage with further
        elements has ``shards_grads``)."""

    @abstractmethod
    def step(self, inner: Any, factor: float, sums: torch.Tensor, release: bool) -> None:
        """The optimizer step, asked for once: the reduced gradients multiplied by ``factor`` (unscale and
        clip), ``inner`` stepped over this stage's masters with the parameters no rank had a gradient for
        left alone (as torch's optimizers leave a parameter whose ``.grad`` is None), and the updated
        masters written into the model's parameters (collective where they are sharded).  ``sums``: the
        further elements of :meth:`step_sums`, summed over the ranks; ``release``: the gradients are dropped
        afterwards, as :meth:`zero_grad` drops them (the engine's step: one call instead of two)."""

    def adding_to_reduced(self) -> contextlib.AbstractContextManager[None]:
        """Around a second reducing backward before one step: the next reduction adds to the last one's result
        instead of replacing it (stage 3's reduction adds to its pieces' gradients already)."""
        return contextlib.nullcontext()

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
    def checkpoint_shards(self, loading: bool, wanted: frozenset[str] = frozenset()) -> contextlib.AbstractContextManager[list[ParamShard]]:
        """This rank's pieces of every parameter with a master: the trainable ones and the frozen ones that keep state
        to resume (empty for inference).

        Saving: the pieces to write.  Loading: frozen parameters named in ``wanted`` (those the checkpoint has optimizer
        state for) get a piece too, so the state lands where it is kept until they train again; on a clean exit the
        frozen pieces' loaded masters are written into the model (collective).
        """

    def save_entries(self, live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full values of the module entries ``live`` (buffers, frozen parameters) that this rank writes: each entry by
        exactly one rank (collective where values must be gathered).  Replicated everywhere, so rank 0 writes them all,
        as DDP keeps rank 0's buffers.
        """
        self.settle()
        return {name: tensor.detach() for name, tensor in live.items()} if self.comm.rank == 0 else {}

    def load_entries(self, live: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Apply]:
        """Fresh full-size tensors to read the module entries ``live`` into, and what puts the values
        read into the model (collective where values must be scattered)."""
        self.settle()
        buffers = {name: torch.empty(t.shape, dtype=t.dtype, device=t.device) for name, t in live.items()}

        def apply() -> None:
            with torch.no_grad():
                for name, tensor in live.items():
                    tensor.copy_(buffers[name])

        return buffers, apply

    def writable_full_params(self) -> contextlib.AbstractContextManager[None]:
        """Inside, every parameter holds its full value, and what rank 0 leaves in them is kept (collective)."""
        self.settle()
        return contextlib.nullcontext()

    @abstractmethod
    def sync_params_from_master(self) -> None:
        """Write master weights into the model's parameters (collective; after loading)."""

    def refresh_trainable(self) -> None:
        """Rebuild whatever depends on the set of trainable parameters."""

    def trainable_changed(self) -> bool:
        """Whether ``requires_grad`` flags differ from those the stage was built for."""
        return False

    def trained_count(self) -> int:
        """How many parameters this stage reduces gradients for (their hooks count ``backward.arrivals``)."""
        return 0

    def has_pending_grads(self) -> bool:
        """Whether gradients were accumulated but not yet reduced and stepped."""
        return False

    def describe_reduction(self) -> Optional[str]:
        """A line for the log at ``initialize`` when how gradients are averaged was chosen, not given."""
        return None

    def settle(self) -> None:
        """Finish anything still in flight that leaves parameters stale (stages 1-2 gather after a step)."""

    def close(self, restore_params: bool = True) -> None:
        """Remove hooks and restore anything the stage changed on the module (``restore_params``: give
        partitioned parameters their full values, else leave them empty; see ``Engine.destroy``)."""
