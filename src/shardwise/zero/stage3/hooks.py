"""Module hooks that gather stage 3 parameters exactly while they are needed (docs/stage3.md, "Hooks"), and
``GatheredParameters`` and ``register_external_parameter`` for reading and writing them outside a forward.

Every submodule gets a forward pre-hook and a forward hook, so the entry point does not matter
(``engine(x)``, ``engine.module(x)``, ``engine.generate(...)``, nested calls).

* **forward**: the pre-hook opens a *call* and gathers the module's units (its direct parameters' and those
  registered with ``register_external_parameter``); the post-hook releases them.  A parameter the running
  forward reads but does not own (``F.linear(x, self.child.weight)``, a tied head) is noticed by its
  ``__torch_function__`` and gathered for the innermost running call.
* **backward**: a hook on the call's outputs re-gathers its units before the module's backward; an identity
  autograd function on its inputs releases them after.  A call whose inputs need no gradient releases a unit
  once its trainable parameters' gradients have all arrived, or at the end of backward.
* **in-place writes** to a held parameter (``w.clamp_(...)``, ``w.data.mul_(...)``; ``.data`` found by a
  checksum) are copied into each rank's shard and fp32 master when the call ends, and folded into the
  group's ledger so ranks that wrote different values fail the next step check (docs/faults.md).
* **prefetch**: the order recorded in one forward drives all-gathers ahead of use in the next, and in reverse
  in backward (``stage3_prefetch_bucket_size``, ``stage3_max_live_parameters``,
  ``stage3_max_reuse_distance``; with ``offload_param: nvme`` the next ``buffer_count`` shards start reading).
  A changed order only wastes prefetches: gathering on use is what guarantees correctness.
* **announcements**: a pass that does not go through an announced engine call (``engine.module(x)``,
  ``loss.backward()``) announces each outermost pass before its first gather (:mod:`shardwise.faults.announce`).

Collectives are issued in program order, so all ranks must run the same modules in the same order in a given
forward (the usual ZeRO-3 / FSDP requirement).
"""

from __future__ import annotations

import contextlib
import enum
from types import TracebackType
from typing import Any, Iterable, Iterator, Optional, Protocol, Sequence, Union

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ...faults.announce import Announcer, register
from ...faults.ledger import current_phase
from ..offload.shards import offloads_params
from .params import (
    Unit,
    UnitState,
    checksum,
    gather_units,
    hold,
    let_go,
    move,
    not_gathered_error,
    outside_graphs,
    param_name,
    prepare_for_compile,
    unit_of,
)

__all__ = [
    "GatheredParameters", "Gatherer", "MasterValues", "TrainingState", "module_units", "register_external_parameter",
]

EXTERNAL_ATTR = "_shardwise_external_params"
_TENSOR_DATA = torch.Tensor.data


class _Call:
    """One invocation of a module's forward, and what it needs in backward."""

    __slots__ = ("module", "units", "positions", "held", "task", "post")

    def __init__(self, module: nn.Module, units: list[Unit]) -> None:
        self.module, self.units = module, units
        self.positions: list[int] = []
        self.held: list[Unit] = []
        self.task, self.post = -1, False


class _PostBackward(torch.autograd.Function):
    """Identity on a call's inputs; its backward runs once the call's backward is done."""

    @staticmethod
    def forward(ctx: Any, gatherer: "Gatherer", call: _Call, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.gatherer, ctx.call = gatherer, call
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.gatherer.post_backward(ctx.call)
        return (None, None, *grads)


class TrainingState(enum.Enum):
    """Where one engine's model is between forward and backward (what its hooks are doing)."""

    #: no forward running, no backward pending
    IDLE = "idle"
    #: a forward (outermost call) is running
    FORWARD = "forward"
    #: a forward with grad enabled finished; its backward has not started
    PRE_BACKWARD = "pre-backward"
    #: autograd is running the backward through the model's calls
    BACKWARD = "backward"


#: the moves of a model's training state; anything else raises
_TRAINING_MOVES: dict[TrainingState, frozenset[TrainingState]] = {
    TrainingState.IDLE: frozenset({TrainingState.FORWARD, TrainingState.BACKWARD}),
    TrainingState.FORWARD: frozenset({TrainingState.PRE_BACKWARD, TrainingState.IDLE}),
    TrainingState.PRE_BACKWARD: frozenset({TrainingState.FORWARD, TrainingState.BACKWARD}),
    # a backward inside a backward (reentrant activation checkpointing) starts another graph task
    TrainingState.BACKWARD: frozenset({TrainingState.IDLE, TrainingState.BACKWARD}),
}


class MasterValues(Protocol):
    """Who keeps copies of the units' values apart from their shards (stage 3's master weights; the first and last
    are :class:`~.params.UnitOwner`'s)."""

    def on_params_modified(self, unit: Unit) -> None: ...

    def on_written(self, unit: Unit) -> None:
        """A forward (or backward) wrote ``unit``'s gathered values in place: keep this rank's slice of them."""

    def on_values_loaded(self, unit: Unit, values: torch.Tensor, loaded: set[int]) -> None: ...


class Gatherer:
    """Owns the gather/free life cycle of one engine's units (the stage 3 ``UnitOwner``): ``units`` is the engine's list
    (filled before :meth:`install`); ``values`` is told of every change of their values not from a step."""

    def __init__(self, module: nn.Module, units: list[Unit], zero_config: Any, values: MasterValues, rank: int) -> None:
        self.module, self.rank, self.units, self.values = module, rank, units, values
        #: per module, the non-persistent units of its direct parameters (set by :meth:`install`)
        self.module_units: dict[nn.Module, list[Unit]] = {}
        self.prefetch_numel = int(zero_config.stage3_prefetch_bucket_size)
        self.max_live = int(zero_config.stage3_max_live_parameters)
        self.reuse_distance = int(zero_config.stage3_max_reuse_distance)
        #: units past the prefetched ones whose shards start coming from their file (`offload_param: nvme`)
        self.read_ahead = int(zero_config.offload_param.buffer_count) if offloads_params(zero_config) else 0
        #: units whose shards this pass (forward or backward) asked to read ahead: settled when it ends
        self._read_ahead: dict[Unit, None] = {}
        self._handles: list[Any] = []
        self._stack: list[_Call] = []
        self._trace: list[Unit] = []
        self._last: list[Unit] = []
        self._next_use: list[Optional[int]] = []
        self._bw_calls: list[_Call] = []
        #: per unit, the backward calls with no post-backward that hold it: released when its gradients are in
        self.held_for_grads: dict[Unit, list[_Call]] = {}
        self._bw_extra: list[Unit] = []
        self._bw_task = -1
        self._bw_trace: list[Unit] = []
        self._bw_cursor = 0
        self._live: set[Unit] = set()
        #: units written in place while gathered -> their checksum before (None: a definite write)
        self._written: dict[Unit, Optional[int]] = {}
        #: units acquired by forwards with grad enabled since the last backward, first use first
        self.forward_order: dict[Unit, None] = {}
        #: what the model is doing; changed only by :meth:`_move`
        self.state = TrainingState.IDLE
        #: the engine's announcements (set by the engine; None: nothing announces, e.g. before it is attached)
        self.announcer: Any = None
        #: the announced pass running now, forward or backward (closed when it ends)
        self._pass: Any = None
        self._backward_pass: Any = None

    def install(self) -> None:
        # Gathering is a collective on Python state: under torch.compile the hooks run eagerly,
        # between graphs (one break per module call), never traced into one.
        prepare_for_compile()
        self.module_units = module_units(self.module)
        pre, post = outside_graphs(self._pre_forward), outside_graphs(self._post_forward)
        for module in self.module.modules():
            self._handles.append(module.register_forward_pre_hook(pre, prepend=True, with_kwargs=True))
            self._handles.append(module.register_forward_hook(post, always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _move(self, to: TrainingState, event: str) -> None:
        """The one place the training state changes: raises on a move the life cycle lacks."""
        if to not in _TRAINING_MOVES[self.state]:  # (checked here: `move` builds the error)
            fix = "forward and backward of one engine must not interleave this way"
            move(self.rank, f"the model ({type(self.module).__name__})", self.state, to, _TRAINING_MOVES, event, fix)
        self.state = to

    def acquire(self, unit: Unit) -> None:
        """Hold ``unit`` gathered (until :meth:`release`)."""
        unit.acquire()
        if not unit.gathered:
            self._live.add(unit)
        try:
            unit.ensure_gathered()
        except BaseException:
            unit.release()  # the caller holds nothing when this raises (a shard that failed to read)
            if unit.state is UnitState.SHARDED:
                self._live.discard(unit)
            raise

    def release(self, unit: Unit, keep: bool = False) -> None:
        """Drop one hold; free the unit when nothing holds it (``keep``: leave it gathered)."""
        if unit.release() == 0 and not keep:
            self.drop(unit)

    def drop(self, unit: Unit) -> None:
        """Free a unit nothing holds (its gathered values are stale or unneeded)."""
        unit.free()
        self._live.discard(unit)

    def free_idle(self) -> None:
        """Free every gathered unit nothing holds (prefetched but unused, kept for reuse)."""
        for unit in list(self._live):
            if unit.holders == 0:
                self.drop(unit)

    def _live_numel(self) -> int:
        return sum(u.numel for u in self._live if u.gathered)

    def _hold(self, units: Sequence[Unit], ahead: Sequence[Unit], later: Sequence[Unit]) -> None:
        """:func:`~.params.hold`, then the shards of ``later`` read ahead from their files (after: the shards needed
        now are read first); where it raises (a shard that failed to read), the units it left sharded are not
        live: nothing frees them at the end of the pass."""
        if units or ahead:
            try:
                hold(units, ahead)
            except BaseException:
                self._live.difference_update([u for u in (*units, *ahead) if u.state is UnitState.SHARDED])
                raise
        for unit in later:
            unit.read_ahead()  # shards kept in files: read while this stretch computes, gathered later
            self._read_ahead[unit] = None

    def _ahead(self, trace: list[Unit], start: int,
               coming: Sequence[Unit] = ()) -> tuple[list[Unit], list[Unit]]:
        """The units of ``trace[start:]`` to gather ahead, within the prefetch budget (``coming``: units about to be
        gathered, counted as live), which become live; and the next units past the budget, whose shards
        to read ahead from their files (``offload_param: nvme``).  Units gathered ahead by earlier calls count
        against the budget (else each call adds a bucket: a 40M GPT had 34M of its 38M elements gathered at once)."""
        budget, live = self.prefetch_numel, None
        index, ahead = start, []
        while index < len(trace) and budget > 0:
            unit = trace[index]
            if unit.gathered and unit not in coming:
                budget -= unit.numel
            elif not unit.gathered and unit not in ahead and unit not in coming:
                if live is None:
                    live = self._live_numel() + sum(u.numel for u in dict.fromkeys(coming) if not u.gathered)
                if live + unit.numel > self.max_live:
                    break
                ahead.append(unit)
                live += unit.numel
                budget -= unit.numel
            index += 1
        self._live.update(ahead)
        return ahead, trace[index : index + self.read_ahead]

    def _settle_read_aheads(self) -> None:
        """A pass ended: shards read ahead for units it did not gather (a branch not taken) stop holding
        read-ahead slots and leave host memory as ``max_in_cpu`` says, instead of staying pending for good."""
        units, self._read_ahead = self._read_ahead, {}
        for unit in units:
            unit.storage.settle_read_ahead()

    def _in_backward(self) -> bool:
        return torch._C._current_graph_task_id() != -1

    def _pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if not self._stack and not self._in_backward():
            self._begin_pass()
        units = list(self.module_units.get(module, ()))
        for param in module.__dict__.get(EXTERNAL_ATTR, ()):
            unit = param.__dict__.get("_shardwise_unit")
            if unit is not None and unit.owner is self and unit not in units:
                units.append(unit)
        call = _Call(module, units)
        self._stack.append(call)
        if units and self._last:  # the next units' gathers start with this call's own (its own waited for below)
            ahead, later = self._ahead(self._last, len(self._trace))
            self._hold((), ahead, later)
        for unit in units:
            self._acquire_for(call, unit)
        if units and torch.is_grad_enabled():
            return self._arm_post_backward(call, args, kwargs)
        return None

    def _acquire_for(self, call: _Call, unit: Unit) -> None:
        self.acquire(unit)  # first: a gather that raises leaves nothing for the post-forward hook to release
        call.positions.append(len(self._trace))
        self._trace.append(unit)
        if torch.is_grad_enabled() and not self._in_backward():
            self.forward_order.setdefault(unit, None)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._stack or self._stack[-1].module is not module:
            return  # hooks installed while this module was already running
        call = self._stack.pop()
        if self._written:
            self._write_back([u for u in call.units if u in self._written])
        for unit, position in zip(call.units, call.positions):
            # kept gathered when the last forward's trace uses it again within the reuse distance (and memory allows)
            distance = self._next_use[position] if position < len(self._last) and self._last[position] is unit else None
            soon = distance is not None and distance <= self.reuse_distance and self._live_numel() <= self.max_live
            self.release(unit, keep=soon)
        if call.units and torch.is_grad_enabled() and output is not None:
            self._arm_pre_backward(call, output)
        if not self._stack and not self._in_backward():
            self._end_pass()

    def _begin_pass(self) -> None:
        if self.state is TrainingState.BACKWARD:
            self._end_backward()  # a backward that raised never ran its final callback
        self._pass = self._announce("forward")  # first: refused, it leaves the model as it was
        self._move(TrainingState.FORWARD, "begin a forward")
        self._trace = []

    def _announce(self, kind: str) -> Any:
        """Announce a stage-3 ``kind`` pass (unless an announced engine call already covers it); the open scope."""
        if self.announcer is None:
            return None
        phase = current_phase()
        where = (", outside any engine call (`engine.module(...)`, the model's own methods)," if phase is None
                 else f", in `{phase}`,")
        grad = "" if torch.is_grad_enabled() else " without grad"
        return self.announcer.scope(f"a stage-3 {kind}{grad}", detail=where).open()

    def _end_pass(self) -> None:
        # with grad, the calls armed pre-backward hooks: the backward may follow
        after = TrainingState.PRE_BACKWARD if torch.is_grad_enabled() else TrainingState.IDLE
        scope, self._pass = self._pass, None
        if scope is not None:
            scope.close()
        self._move(after, "end a forward")
        self._write_back(list(self._written))  # persistent units, and units written outside their call
        self.free_idle()
        self._settle_read_aheads()
        self._last = self._trace
        self._next_use = _next_use(self._last)
        self._trace = []

    def needs(self, unit: Unit) -> bool:
        """Freed, or read by a running forward that did not gather it (its backward must re-gather it)."""
        if not unit.gathered:
            return True
        return bool(self._stack) and not unit.persistent and unit not in self._stack[-1].units

    def on_demand(self, units: list[Unit], func: Any, mutating: bool) -> contextlib.AbstractContextManager[None]:
        """A running forward (or backward) read parameters it does not own: gather them for it."""
        if self._stack:
            call = self._stack[-1]
            for unit in units:
                if unit not in call.units:
                    call.units.append(unit)
                    self._acquire_for(call, unit)
                else:
                    unit.ensure_gathered()
            return contextlib.nullcontext()
        if self._in_backward():
            for unit in units:
                self._bw_extra.append(unit)
                self.acquire(unit)
            self._ensure_backward_callback()
            return contextlib.nullcontext()
        freed = [p for u in units for p in u.params if not u.gathered]
        if not freed:
            return contextlib.nullcontext()
        raise not_gathered_error(freed[0], func)

    def on_data_access(self, unit: Unit) -> None:
        self.on_demand([unit], _TENSOR_DATA, False)

    def on_traced_read(self, unit: Unit, param: torch.Tensor) -> None:
        """torch.compile traces a read of ``param`` (once; replays skip this): the running module
        gathers its unit on every call from now on, as if it were registered as external."""
        if unit.persistent:
            return
        if not self._stack:
            raise RuntimeError(
                f"rank {unit.comm.rank}: a compiled function reads parameter `{param_name(param)}`, which ZeRO "
                "stage 3 partitions, outside any forward of the engine's model, where nothing gathers it on "
                "each call; compile the module (`engine.compile()`, or `torch.compile(model)` before "
                "`shardwise.initialize`) instead of a function around it, or run that function eagerly")
        call = self._stack[-1]
        if unit in call.units:
            return
        external = call.module.__dict__.setdefault(EXTERNAL_ATTR, [])
        if not any(p is param for p in external):
            external.append(param)
        self.on_demand([unit], _TENSOR_DATA, False)

    def on_cast(self, unit: Unit, device: Optional[torch.device], dtype: Optional[torch.dtype]) -> bool:
        return False

    def on_params_modified(self, unit: Unit) -> None:  # (`GatheredParameters(modifier_rank=...)` wrote it)
        self.values.on_params_modified(unit)

    def on_write(self, unit: Unit) -> contextlib.AbstractContextManager[None]:
        if self._stack or self._in_backward():
            self._written[unit] = None  # written back when the call holding it ends
            return contextlib.nullcontext()
        if unit.persistent and unit.holders == 0:
            return self._writing(unit)  # always gathered, no call will end: write back right after
        return contextlib.nullcontext()  # inside `GatheredParameters`: its `modifier_rank` decides

    def on_gathered_data_access(self, unit: Unit) -> None:
        """``param.data`` of a gathered unit was taken: inside a call, hold it for the call, it may be written; outside,
        a persistent unit no block holds may be written too, and is looked at when a pass ends or the engine next reads
        its masters (:meth:`take_written`).  (A unit ``GatheredParameters`` holds: its ``modifier_rank`` decides.)"""
        if not (self._stack or self._in_backward()):
            if unit.persistent and unit.holders == 0 and unit not in self._written:
                unit.settle()
                self._written[unit] = checksum(unit.full)
            return
        if self.needs(unit):
            self.on_data_access(unit)  # held for the running call like any read (and a prefetch finishes first)
        unit.settle()
        if unit not in self._written:
            self._written[unit] = checksum(unit.full)

    @contextlib.contextmanager
    def _writing(self, unit: Unit) -> Iterator[None]:
        yield
        self._written[unit] = None
        self._write_back([unit])

    def _write_back(self, units: list[Unit]) -> None:
        for unit in units:
            before = self._written.pop(unit)
            if not unit.gathered:
                continue
            after = checksum(unit.full)
            if before is not None and before == after:
                continue  # `.data` was only read
            self.values.on_written(unit)
            # No collective: the step check compares this note, so different writes on different ranks fail it.
            unit.comm.record("in-place write", unit.numel, unit.full.dtype, f"{unit.label}, values {after:x}")

    def take_written(self) -> None:
        """Outside a pass: what was written through ``param.data`` of a persistent unit since reaches its shard and
        masters (the step, a checkpoint and the full masters read them)."""
        if self._written and not (self._stack or self._in_backward()):
            self._write_back(list(self._written))

    def on_values_loaded(self, unit: Unit, values: torch.Tensor, loaded: set[int]) -> None:  # (`zero.load_state_dict`)
        self.values.on_values_loaded(unit, values, loaded)

    def _arm_post_backward(self, call: _Call, args: Any, kwargs: Any) -> Any:
        flat, spec = tree_flatten((args, kwargs))
        where = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor) and v.requires_grad]
        if not where:
            return None
        outputs = _PostBackward.apply(self, call, *[flat[i] for i in where])
        for i, value in zip(where, outputs):
            flat[i] = value
        call.post = True
        return tree_unflatten(flat, spec)

    def _arm_pre_backward(self, call: _Call, output: Any) -> None:
        flat, _ = tree_flatten(output)
        tensors = [v for v in flat if isinstance(v, torch.Tensor) and v.requires_grad]
        if not tensors and hasattr(output, "__dict__"):
            tensors = [v for v in vars(output).values() if isinstance(v, torch.Tensor) and v.requires_grad]

        def hook(grad: torch.Tensor) -> None:
            self._pre_backward(call)

        for tensor in tensors:
            tensor.register_hook(hook)

    def _ensure_backward_callback(self) -> None:
        task = torch._C._current_graph_task_id()
        if task != self._bw_task:
            # no announcement of its own with no announcer, on one rank, or inside an announced operation (the engine's
            # own `backward`; a reentrant backward inside one): read here, every backward passes this check
            announcer = self.announcer
            covered = announcer is None or not announcer.comm.distributed or announcer.comm.ledger.scope is not None
            if self._backward_pass is None and not covered:
                self._backward_pass = self._announce("backward")
            self._move(TrainingState.BACKWARD, "begin a backward")
            self._bw_task = task
            self._bw_trace = list(reversed(self._last))
            self._bw_cursor = 0
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _pre_backward(self, call: _Call) -> None:
        task = torch._C._current_graph_task_id()
        if call.task == task:
            return
        call.task = task
        self._ensure_backward_callback()
        self._live.update(unit for unit in call.units if not unit.gathered)
        trace = self._bw_trace  # ahead: the units after the call's in the reversed forward order
        for index in range(self._bw_cursor, len(trace)):
            if trace[index] in call.units:
                self._bw_cursor = index + 1
                break
        # the call's own gathers and the next ones in one call, then the call's waited for
        ahead, later = self._ahead(trace, self._bw_cursor, call.units)
        self._hold(call.units, ahead, later)
        call.held = list(call.units)
        self._bw_calls.append(call)
        if not call.post:
            for unit in call.units:
                self.held_for_grads.setdefault(unit, []).append(call)


    def post_backward(self, call: _Call) -> None:
        held, call.held = call.held, []
        if held:
            self._live.difference_update(let_go(held))

    def grads_ready(self, unit: Unit) -> None:
        """All trainable parameters of ``unit`` have their gradient: calls with no post-backward let go."""
        done = []
        for call in self.held_for_grads.pop(unit, ()):
            if unit in call.held:
                call.held.remove(unit)
                done.append(unit)
        if done:
            self._live.difference_update(let_go(done))

    def _end_backward(self) -> None:
        if self._written:
            self._write_back(list(self._written))
        for call in self._bw_calls:
            self.post_backward(call)
        extra, self._bw_extra = self._bw_extra, []
        if extra:
            self._live.difference_update(let_go(extra))
        self._bw_calls, self.held_for_grads, self._bw_task = [], {}, -1
        scope, self._backward_pass = self._backward_pass, None
        if scope is not None:
            scope.close()
        self._move(TrainingState.IDLE, "end a backward")
        self.free_idle()
        self._settle_read_aheads()

    def abort_forward(self) -> None:
        """The engine's forward raised past the module hooks (a ``KeyboardInterrupt`` skips torch's always-called
        post-hooks): let go of what its calls held, as their ends would have."""
        while self._stack:
            self._post_forward(self._stack[-1].module, (), None)  # what the skipped hook would have done
        if self.state is TrainingState.FORWARD:
            self._end_pass()

    def abort_backward(self) -> None:
        """The engine's backward raised partway: let go of what it held, as its end would have."""
        if self.state is TrainingState.BACKWARD:
            self._end_backward()
        self.forward_order = {}


def module_units(root: nn.Module) -> dict[nn.Module, list[Unit]]:
    """Per module of ``root``, the non-persistent units holding its direct parameters (tied: every holder's)."""
    holders: dict[nn.Module, list[Unit]] = {}
    for module in root.modules():
        found: list[Unit] = []
        for param in module._parameters.values():
            holder = unit_of(param)
            if holder is not None and not holder.persistent and holder not in found:
                found.append(holder)
        if found:
            holders[module] = found
    return holders


def _next_use(trace: list[Unit]) -> list[Optional[int]]:
    """For each position, the elements gathered before the same unit is used again (None: never)."""
    result: list[Optional[int]] = [None] * len(trace)
    seen: dict[int, int] = {}
    prefix = [0]
    for unit in trace:
        prefix.append(prefix[-1] + unit.numel)
    for position in range(len(trace) - 1, -1, -1):
        unit = trace[position]
        later = seen.get(id(unit))
        if later is not None:
            result[position] = prefix[later] - prefix[position + 1]
        seen[id(unit)] = position
    return result


# ------------------------------------------------ outside a forward: GatheredParameters, external parameters
class GatheredParameters:
    """Inside the block, the given partitioned parameters hold their full values (collective).

    Every rank must enter it with the same parameters in the same order.
    Without ``modifier_rank`` the block is read-only: writes are discarded
    when it exits.  With ``modifier_rank=r``, what rank ``r`` wrote is
    broadcast on exit and re-partitioned on every rank (and, when a stage 3
    engine owns the parameters, copied into its fp32 master weights).
    Parameters that are not partitioned (another stage, a plain module) are
    left alone, so the same code runs at every stage::

        with shardwise.zero.GatheredParameters(model.head.weight, modifier_rank=0):
            if dist.get_rank() == 0:
                model.head.weight[:10].zero_()

    ``fwd_module`` is accepted for DeepSpeed compatibility and ignored.  Collective, so it announces itself first
    (:mod:`shardwise.faults.announce`): a rank entering it alone raises, with the others, before anything is gathered.
    """

    def __init__(self, params: Union[torch.Tensor, Iterable[torch.Tensor], None], modifier_rank: Optional[int] = None,
                 fwd_module: Optional[nn.Module] = None, enabled: bool = True) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = list(params) if params is not None and enabled else []
        self.modifier_rank = modifier_rank
        self._scope: Any = None
        self.units: list[Unit] = []
        for param in self.params:
            if not isinstance(param, torch.Tensor):
                raise TypeError(
                    f"GatheredParameters got a `{type(param).__name__}`; pass a parameter or a list of "
                    "parameters, e.g. `GatheredParameters(module.parameters())`")
            unit = unit_of(param)
            if unit is not None and unit not in self.units:
                self.units.append(unit)
        if modifier_rank is not None and self.units:
            world = self.units[0].comm.world_size
            if not 0 <= modifier_rank < world:
                raise ValueError(
                    f"modifier_rank={modifier_rank} is not a rank of the parameters' process group "
                    f"(size {world}); pass a rank in [0, {world}) or None for read-only access")

    def __enter__(self) -> "GatheredParameters":
        if self.units:
            # its engine announces; a model under `zero.Init` not yet wrapped, a bare announcer on its group
            announcer = getattr(self.units[0].owner, "announcer", None)
            if not isinstance(announcer, Announcer):
                announcer = Announcer(self.units[0].comm, "a model partitioned by `zero.Init`", engine=False)
            self._scope = announcer.scope("GatheredParameters").open()
        try:
            for unit in self.units:
                unit.acquire()
            gather_units(self.units)
        except BaseException:
            self._close()
            raise
        return self

    def _close(self) -> None:
        scope, self._scope = self._scope, None
        if scope is not None:
            scope.close()

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        try:
            if self.modifier_rank is not None and exc_type is None:
                for unit in self.units:
                    unit.take_full(src=self.modifier_rank)
                    unit.owner.on_params_modified(unit)
            elif self.modifier_rank is None:
                # Read-only: undo local writes so the full values keep matching the shards.
                for unit in self.units:
                    if unit.holders > 1 or unit.persistent:
                        unit.refresh()
        finally:
            try:
                for unit in self.units:
                    unit.owner.release(unit)
            finally:
                self._close()


register("GatheredParameters.__enter__", "GatheredParameters")


def register_external_parameter(module: nn.Module, parameter: torch.Tensor) -> None:
    """Gather ``parameter`` whenever ``module`` runs, like its own parameters.

    A parameter read inside a module's forward that belongs to another module (``F.linear(x, self.child.weight)`` on a
    child the forward never calls) is gathered automatically at stage 3; registering it only lets the gather happen up
    front, with prefetching, instead of at the first read.  Works before or after ``shardwise.initialize``; a no-op for
    parameters that are not partitioned.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"register_external_parameter: `module` must be a torch.nn.Module, got `{type(module).__name__}`")
    if not isinstance(parameter, torch.Tensor):
        raise TypeError(
            f"register_external_parameter: `parameter` must be a tensor (an nn.Parameter), got "
            f"`{type(parameter).__name__}`")
    registered = module.__dict__.setdefault(EXTERNAL_ATTR, [])
    if not any(p is parameter for p in registered):
        registered.append(parameter)

