"""The flat stages 0, 1 and 2 (``Stage0``, ``Stage1``, ``Stage2``) over their shared base: full parameters on every
rank.

What the three share lives in :class:`FlatStrategy`: the :class:`~.layout.FlatLayout`, the step over this rank's
masters (the master store's, :mod:`..store`, its model side :class:`FlatSide`), the all-gather of the updated slices
behind the next forward, and carrying state across a change of the trainable set.  Gradients live in the stage's
:attr:`FlatStrategy.grad_storage` (:mod:`.grads`), whose hooks launch complete buckets themselves.  A stage differs
only in how it reduces (its ``_reduction``) and which storage it uses; the stages, and why the all-gathers run behind
the next forward (:class:`PendingGathers`, :class:`GatheringParameter`), are in docs/zero.md.

:class:`FlatSide`: the trainable parameters become views of one flat buffer of the compute dtype, so this rank's slice
of each bucket is where its updated values go and one all-gather per bucket, in place, brings the others'.  In fp32
that slice is the masters itself (the store's :class:`~..store.store.Resident` home steps it in place); stage 0 in
fp32 keeps the parameters' own storage and steps them as DDP does (:attr:`FlatSide.whole`).  A frozen parameter keeps
its own storage; the store keeps its master whole.  Reading or setting ``.grad`` and reading ``.requires_grad`` touch
no values and do not wait for a bucket in flight; the strategy waits for everything itself before anything that
writes parameters or masters (backward, step, loading, changing the trainable set, closing).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from abc import abstractmethod
from typing import Any, Callable, Iterator, MutableMapping, Optional, Sequence

import torch
from torch import nn

from ...comm.distributed import Comm, Work, wait_all
from ...optim.param_state import KeptSlot, ParamShard, copy_value, is_per_element
from ..base import Strategy, group_index, module_order, remove_with, tensor_bytes
from ..store import choose_home
from ..store.plan import OffloadSpec, offload_spec
from ..store.store import Kept, MasterStore, Piece, Resident, Runs
from .grads import (
    Allocate,
    FlatGrads,
    GradStorage,
    Reduce,
    StagedGrads,
    all_reduce_in_place,
    all_reduce_keeping_slice,
    private_zeros,
    reduce_scatter_slice,
)
from .layout import FlatLayout

__all__ = [
    "FlatSide", "FlatStrategy", "GatheringParameter", "PendingGathers", "Stage0", "Stage1", "Stage2", "export_state",
    "uses_reduce_scatter",
]


class FlatStrategy(Strategy):
    """Base of stages 0-2; see the module docstring."""

    #: where this stage keeps gradients (:mod:`.grads`)
    grad_storage: type[GradStorage] = FlatGrads

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.num_shards = self._num_shards()
        self.shards_grads = self.num_shards > 1
        # Gradients are averaged by pre-dividing the loss (see Strategy.loss_divisor).
        self.loss_divisor = float(self.comm.world_size)
        self.device = torch.device("cpu")
        #: the optimizer offload asked for (`attach` reads it once; every layout's home follows it)
        self._offload: Optional[OffloadSpec] = None
        # empty until `attach` builds them (inference: they stay empty)
        self.layout = FlatLayout([], 1, 1, 0)
        self.grads: GradStorage = self._storage(private_zeros)
        self.side = FlatSide(self.layout, self.precision.dtype, self.device, whole=True)
        #: this rank's masters and optimizer state (:mod:`.store`), rebuilt with the layout (frozen ones kept)
        self.store = MasterStore(Resident(self.side, True))
        #: per bucket, (the model's region of it, this rank's updated slice inside it): what the step
        #: all-gathers (empty with one shard: the step wrote every parameter)
        self._gathers: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: updated parameters still being gathered; waited for on first use (:class:`PendingGathers`)
        self.pending = PendingGathers()
        self._hooks: list[Any] = []
        self._order: list[nn.Parameter] = []
        self._mask: tuple[bool, ...] = ()
        self._dirty = False
        #: indices of the parameters no rank had a gradient for at the last reduction: the step leaves them alone
        self._unused: list[int] = []
        #: parameters another model-parallel rank counts in the norm, and their reduced gradients (per layout)
        self._elsewhere: frozenset[str] = frozenset()
        self._uncounted: list[torch.Tensor] = []
        #: each parameter's version counter when its masters last agreed with it (:meth:`take_written`)
        self._versions: dict[int, int] = {}

    def _num_shards(self) -> int:
        return self.comm.world_size

    def attach(self, inner: Optional[Any], initial: Optional[dict[int, torch.Tensor]] = None) -> None:
        super().attach(inner, initial)
        if inner is None:
            return
        self._groups = [list(group["params"]) for group in inner.param_groups]
        self._order = module_order(self.module, self._groups)
        # asked once: a rebuild of the layout keeps the home chosen at initialize
        device = next((p.device for p in self._order), torch.device("cpu"))
        self._offload = offload_spec(self.zero_config, self.comm.rank, device)
        self._build(self.initial)
        self.initial = {}  # only needed once: let the fp32 originals go

    def _build(self, initial: dict[int, torch.Tensor]) -> None:
        params = [p for p in self._order if p.requires_grad]
        self._mask = tuple(p.requires_grad for p in self._order)
        rank = self.comm.rank if self.num_shards > 1 else 0
        self.layout = FlatLayout(params, self.zero_config.reduce_bucket_size, self.num_shards, rank)
        self.device = params[0].device if params else torch.device("cpu")
        # memory every rank maps when collectives go through shared memory (a reduction then reads the peers' gradients
        # in place), else this process's own; the same choice on every rank
        self.grads = self._storage(self.comm.shm.zeros if self.comm.shm.active else private_zeros)
        self._build_store(params, initial)
        self._uncounted = self._reduced_grads_of(self._elsewhere)
        # fixed views for the life of this layout; one shard: the step wrote every parameter, nothing to gather
        self._gathers = self.side.gather_pairs()
        for group, originals in zip(self.inner.param_groups, self._groups):
            group["params"] = self.store.keys_for(originals)
        # straight to the storage (no stop here on the way), held weakly: a dropped engine is freed (`remove_with`)
        hooks = [param.register_post_accumulate_grad_hook(self.grads.hook(index))
                 for index, param in enumerate(self.layout.params)]
        self._hooks.extend(hooks)
        remove_with(self.grads, hooks)
        self._unused = []
        self._note_versions()

    def _build_store(self, params: list[nn.Parameter], initial: dict[int, torch.Tensor]) -> None:
        """The master store for this layout: the home chosen as at initialize, the frozen entries carried over.  The
        parameters are stepped themselves (no flat buffer, no copy) where nothing is sharded or offloaded, the model is
        fp32 and ``param.grad`` holds the full averaged gradient (stage 0); each other key's ``.grad`` is its fixed view
        of this rank's reduced gradients."""
        layout, dtype, fp32 = self.layout, self.precision.dtype, self.precision.dtype == torch.float32
        offload = self._offload
        whole = offload is None and fp32 and layout.num_shards == 1 and self.grads.in_params
        self.side = FlatSide(layout, dtype, self.device, whole)
        self.store = MasterStore(choose_home(self.side, offload, fp32, self.device, dtype), self.store.frozen)
        training = {id(p) for p in params}
        names = {id(p): n for n, p in self.module.named_parameters()}
        pieces = self.side.pieces(names, group_index(self._groups), [p for p in self._order if id(p) not in training])
        self.store.plan(layout.pieces, layout.shard_numel, self.inner)
        try:
            for piece in pieces:
                source = initial.get(id(piece.param), piece.param.data).reshape(-1)
                self.store.add(piece, source[piece.start : piece.end] if piece.at >= 0 else None)
        except BaseException:  # refused or failed at initialize: an offload folder is not left behind
            self.store.close()
            raise
        reduced, home = self.grads.reduced.slices, self.store.home
        landing: list[list[Piece]] = [[] for _ in layout.buckets]  # per bucket, its pieces (for the home's copies)
        for piece, run in zip(pieces, layout.pieces):
            if piece.key is not None and piece.key is not piece.param:
                bucket, _ = layout.bucket_of[run.param]
                grad = reduced[bucket.index].narrow(0, run.shard_offset - bucket.shard_offset, run.numel)
                piece.key.grad = home.grad_for(piece, grad)
                landing[bucket.index].append(piece)
        if home.grads_apart:
            self.grads.landed = lambda bucket: home.arrived(landing[bucket.index])

    def _storage(self, allocate: Allocate) -> GradStorage:
        # fp16/bf16: every stage stages its gradients in fp32 at the boundary (no full-size low-precision buffer kept
        # beside the fp32 one the optimizer reads: 2 bytes a parameter less, docs/zero.md)
        if self.precision.dtype == torch.float32:
            return self.grad_storage(self.layout, self.precision.dtype, self.device, allocate, self.backward,
                                     self._reduction(), self.precision.reduce_dtype)
        # one process, masters in memory: each bucket's fp32 gradients have memory only from its first gradient in a
        # reducing backward to the step, as FSDP2's (docs/zero.md). Not with ranks to reduce with: there the memory
        # comes back each step from the system on a CPU job (stage 0 at 2 ranks, 40m bf16: 0.87-0.92x DDP's time
        # before, 0.97-1.01x with it), and DDP keeps its buckets too
        per_bucket = self.comm.world_size == 1 and self._offload is None
        return StagedGrads(self.layout, self.precision.dtype, self.device, allocate, self.backward, self._reduction(),
                           self.precision.reduce_dtype, per_bucket)

    def run_backward(self, tensor: torch.Tensor, sync: bool, retain_graph: bool = False) -> None:
        self.start_backward(sync)
        try:
            tensor.backward(retain_graph=retain_graph)  # the hooks are called from here
        except BaseException:
            self.abort_backward()
            raise
        self.finish_backward()

    def start_backward(self, sync: bool) -> None:
        self.settle()  # parameters no forward used, and masters the next step writes
        backward = self.backward
        backward.sync, backward.active, backward.arrivals = sync, True, 0
        backward.serial += 1  # the storage starts this backward afresh at its first hook
        self._dirty = True

    @abstractmethod
    def _reduction(self) -> Reduce:
        """The stage's collective (:data:`.grads.Reduce`, one of the functions in :mod:`.grads` bound to this
        strategy's ``Comm``), chosen once per layout: the storage hands it each complete bucket."""

    def abort_backward(self) -> None:
        self.backward.active = False
        if self.backward.sync:
            self.grads.drain()

    def finish_backward(self) -> None:
        self.backward.active = False
        if not self.backward.sync:
            return
        had = self.grads.finish()
        # DDP's `find_unused_parameters`: torch's optimizers leave a parameter whose `.grad` is None alone (no
        # momentum, no weight decay), and so does the step here for one no rank had a gradient for
        if not self.comm.distributed:  # this rank's flags are the answer: no round trip through the device
            self._unused = [index for index, flag in enumerate(had) if not flag]  # (on CUDA, two waits for it)
            return
        used = torch.tensor(had, dtype=torch.float32, device=self.device)
        self.comm.all_reduce(used, label="which parameters had gradients")
        self._unused = (used == 0).nonzero().view(-1).tolist()

    @contextlib.contextmanager
    def adding_to_reduced(self) -> Iterator[None]:
        """A second reducing backward before the step: this rank's reduced gradients are kept aside, the
        gradients cleared (so the next ones overwrite the buffer), and the kept ones added to the new
        reduction; a parameter either backward used counts as used."""
        self.settle()
        self.grads.reduced.ensure()
        kept = [grad.clone() for grad in self.grads.reduced.slices]
        unused = set(self._unused)
        self.zero_grad()
        yield
        for grad, earlier in zip(self.grads.reduced.slices, kept):
            grad.add_(earlier)
        self._unused = sorted(unused & set(self._unused))

    def step_sums(self) -> torch.Tensor:
        """This rank's sum of squared reduced gradients (taken while the reduction was waited for); the
        "had a gradient" flags were summed at the end of backward, where DDP leaves unused ``.grad`` None."""
        self.grads.reduced.ensure()  # (released when no reducing backward ran since the last step)
        total = self.grads.reduced.norm_share().reshape(1).clone()  # (a copy: the sum is taken in place)
        for grad in self._uncounted:
            total[0] -= torch.dot(grad, grad)
        return total

    def count_elsewhere(self, names: frozenset[str]) -> None:
        """Leave the gradients of the parameters ``names`` out of :meth:`step_sums`, now and after every
        rebuild of the layout: another model-parallel rank counts them (a pipeline's tied copies, whose first
        holder is another stage, :mod:`shardwise.pipe.ties`)."""
        self._elsewhere = names
        self._uncounted = self._reduced_grads_of(names)

    def _reduced_grads_of(self, names: frozenset[str]) -> list[torch.Tensor]:
        """This rank's pieces of the reduced fp32 gradients of the trainable parameters ``names``."""
        named = {id(p): n for n, p in self.module.named_parameters()} if names else {}
        found = []
        for piece in self.layout.pieces:
            if named.get(id(self.layout.params[piece.param])) in names:
                bucket, _ = self.layout.bucket_of[piece.param]
                start = piece.shard_offset - bucket.shard_offset
                found.append(self.grads.reduced.slices[bucket.index].narrow(0, start, piece.numel))
        return found

    def step(self, inner: Any, factor: float, sums: torch.Tensor, release: bool) -> None:
        self.settle()
        self.take_written()
        self.grads.reduced.ensure()  # the keys' `.grad` are views of it
        apart = self.store.home.grads_apart  # the optimizer reads host copies: the store scales those
        if factor != 1.0 and not apart:
            self.grads.reduced.scale(factor)
        unused = []  # no rank had a gradient for them: left alone while the optimizer steps
        for index in self._unused:
            param = self.layout.params[index]
            param.grad = None  # not a use of the values (see `PendingGathers`); it stays None, as DDP leaves it
            if (piece := self.store.by_param.get(id(param))) is not None:
                unused.append(piece)
        with self._compute_copy_freed():
            self.store.step(inner, factor if apart else 1.0, unused)  # steps (an offloaded home a sub-group at a time) and publishes
        if release:
            self._forget_grads()
        self._regather()

    @contextlib.contextmanager
    def _compute_copy_freed(self) -> Iterator[None]:
        """fp16/bf16 with resident fp32 masters and one shard: the flat parameter buffer (a compute-dtype copy of the
        masters) is freed while the optimizer steps, as FSDP2 frees its unsharded parameters after backward; the publish that
        ends the step writes every piece again (then the all-gather the rest).  The step peak is then masters,
        optimizer state, gradients and the optimizer's temporaries, without that copy (docs/benchmarks.md, 1.2B
        width on the CPU)."""
        # masters in memory apart from the model (every step publishes them all), and one shard only (stage 0, or one
        # process): this rank's masters are every value, so a step that raises still leaves the model whole (the other
        # ranks' slices would need an all-gather the failure never reaches)
        if not (self._offload is None and not self.store.home.in_model and self.side.param_flat.numel()
                and self.layout.num_shards == 1):
            yield
            return
        self.side.free_values()
        try:
            yield
        except BaseException:
            self.side.restore_values()
            self.store.publish()  # the masters as the step left them, not freed memory
            raise
        self.side.restore_values()  # (already done by the publish: nothing then)

    def take_written(self) -> None:
        """Parameters a script wrote in place since the masters last agreed with them (``model.load_state_dict``,
        ``nn.init``, a write under ``torch.no_grad()``, in a forward too: their version counters moved) give this
        rank's masters of them, kept ones too, the values written, as plain torch would step from them.  A write
        through ``param.data`` moves no counter and is not seen (docs/zero.md).  fp32 masters that are the
        parameters' own storage took every write already."""
        if self.inner is None or self.store.home.in_model:
            return
        with torch._C.DisableTorchFunctionSubclass():  # (a counter read is not a use: no wait for a bucket in flight)
            written = [p for p in self._order if p._version != self._versions.get(id(p), p._version)]
        for param in written:
            piece = self.store.by_param.get(id(param))
            if piece is None or (master := self.store.master_or_kept(piece)) is None:
                continue
            values = self.side.values(piece)
            # only where the values changed (a clamp that clamped nothing moves the counter too): the others' fp32
            # masters keep their exact values, a copy would round them
            if not torch.equal(values, master.to(param.dtype).to(values)):
                self.store.take(piece, values)
        if written:
            self._note_versions()

    def _note_versions(self) -> None:
        """The parameters and their masters agree now (the step's and a load's own writes move no counter)."""
        with torch._C.DisableTorchFunctionSubclass():
            self._versions = {id(p): p._version for p in self._order}

    def sync_params_from_master(self) -> None:
        self.settle()
        self.store.publish()
        self._regather()

    def _regather(self) -> None:
        """Start the all-gather of every bucket's updated slice, in forward order, and return.  The last bucket holds
        the first layers (buckets follow backward order), so it goes first.
        """
        params, buckets = self.layout.params, self.layout.buckets[::-1]
        works = self.comm.all_gather_each(self._gathers[::-1], [f"parameters, bucket {b.index}" for b in buckets])
        self.pending.start([(b.index, work, [params[i] for i in b.params]) for b, work in zip(buckets, works)])

    def settle(self) -> None:
        if self.pending.works:  # (read, not asked: nothing is in flight once a forward used every parameter)
            self.pending.wait_all()

    def zero_grad(self) -> None:
        """Gradients become None, as torch's default; the storage is overwritten, not zeroed (:mod:`.grads`)."""
        self._forget_grads()

    def _forget_grads(self) -> None:
        self._dirty = False
        for param in self.layout.params:
            param.grad = None  # not a use of the values: no wait for a gather in flight (see `PendingGathers`)
        self.grads.reduced.release()

    def has_pending_grads(self) -> bool:
        return self._dirty

    def trained_count(self) -> int:
        return len(self.layout.params)

    def trainable_changed(self) -> bool:
        # Reading flags is not a use of the values: it does not wait for a gather in flight (see `PendingGathers`).
        return self.inner is not None and tuple(p.requires_grad for p in self._order) != self._mask

    def refresh_trainable(self) -> None:
        """Rebuild layout, buffers, hooks and optimizer pieces for the current ``requires_grad`` flags.  Master weights
        and optimizer state move with their parameters; a parameter that stops training keeps them in the frozen store.
        """
        if self.inner is None:
            return
        self.settle()
        self.take_written()
        carried = export_state(self.layout, self.store, self.inner.state, self.comm, self.gather_flat,
                               self.side.whole, self.device)
        self.close()
        for param in self.layout.params:
            param.grad = None
        self.side.release()
        self._build({})
        frozen = self.store.frozen
        for param in self.layout.params:
            kept = frozen.take(param)
            if kept is not None:
                carried.setdefault(id(param), kept)
        self.store.adopt(carried, self.inner.state)
        training = {id(p) for p in self.layout.params}
        for param in self._order:
            if id(param) not in training and id(param) in carried:
                frozen.keep(param, carried[id(param)])

    @contextlib.contextmanager
    def checkpoint_shards(self, loading: bool, wanted: frozenset[str] = frozenset()) -> Iterator[list[ParamShard]]:
        self.settle()
        if self.inner is None:
            yield []
            return
        self.take_written()
        with self.store.shards(self.inner.state, loading, wanted) as shards:
            yield shards
        if loading:
            self._note_versions()  # what the load wrote into parameters, its masters hold too

    def memory_breakdown(self) -> dict[str, int]:
        params = {id(p): p for p in self.module.parameters()}
        state = getattr(self.inner, "state", {}) if self.inner is not None else {}
        return {"parameters": tensor_bytes(list(params.values())), "master_weights": self.store.master_bytes(),
                "gradients": self.grads.nbytes(), "optimizer_state": self.store.state_bytes(state)}

    def full_master_weights(self) -> dict[int, torch.Tensor]:
        self.settle()
        if self.inner is None:
            return {}
        self.take_written()
        layout = self.layout
        if self.precision.dtype == torch.float32:  # the parameters hold the masters' exact values once published
            self.store.publish()
            result = {id(p): p.detach().clone() for p in layout.params}
        else:
            flat = self.gather_flat(self.store.shard(layout.shard_numel, self.device))
            result = {id(p): layout.param_slice(flat, i).view_as(p).clone() for i, p in enumerate(layout.params)}
        # frozen parameters keep their fp32 master in the store until they train again
        for param in self._order:
            kept = self.store.frozen.get(param)
            if kept is not None:
                result[id(param)] = kept.master.view(param.shape).clone()
        return result

    def gather_flat(self, shard: torch.Tensor) -> torch.Tensor:
        """The full-size flat tensor whose slices, across ranks, are ``shard`` (collective)."""
        layout = self.layout
        if self.num_shards == 1:
            return shard
        full = shard.new_empty(layout.padded_numel)
        for bucket in layout.buckets:
            self.comm.all_gather(layout.bucket_slice(full, bucket), layout.shard_slice(shard, bucket))
        return full

    def close(self, restore_params: bool = True) -> None:
        self.settle()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.store.close()



class Stage0(FlatStrategy):
    """Replicated parameters, gradients and optimizer state; bucketed all-reduce."""

    stage = 0

    def _num_shards(self) -> int:
        return 1

    def _reduction(self) -> Reduce:
        return functools.partial(all_reduce_in_place, self.comm)


def uses_reduce_scatter(setting: Optional[bool], backend: str, shared_memory: bool = False) -> bool:
    """How stages 1-2 average gradients: DeepSpeed's ``reduce_scatter`` when set, else by transport.

    gloo's reduce-scatter over sockets takes ~1.8x its all-reduce of the same bucket (measured at 40M
    parameters, docs/benchmarks.md), so there the all-reduce wins despite sending twice the bytes.  Through
    shared memory (:mod:`shardwise.comm.shm`) and on NCCL the reduce-scatter is the cheaper one (20 MB, 2 ranks,
    shared memory: 4.2 against 5.4 ms).
    """
    return setting if setting is not None else backend != "gloo" or shared_memory


class Stage1(FlatStrategy):
    """Sharded master weights and optimizer state; full gradients."""

    stage = 1

    @property
    def reduce_scatter(self) -> bool:
        """Whether buckets are reduce-scattered (else all-reduced, this rank's slice kept)."""
        return uses_reduce_scatter(self.zero_config.reduce_scatter, self.comm.backend, self.comm.shm.active)

    def describe_reduction(self) -> str:
        how = "reduce-scatter" if self.reduce_scatter else "all-reduce, keeping this rank's slice"
        why = "as configured" if self.zero_config.reduce_scatter is not None else f"chosen for {self.comm.shm.name(self.comm.backend)}"
        return f"gradients averaged by {how} ({why}: `zero_optimization.reduce_scatter`)"

    def _reduction(self) -> Reduce:
        return functools.partial(reduce_scatter_slice if self.reduce_scatter else all_reduce_keeping_slice, self.comm)


class Stage2(Stage1):
    """Sharded master weights, optimizer state and gradients; reduces and regathers as stage 1 does."""

    stage = 2
    grad_storage = StagedGrads


# ------------------------------------------------ the store's side: this rank's slice of the flat parameter buffer
class FlatSide:
    """The model's parameters for ``layout`` (see the module docstring); ``whole``: they are stepped themselves."""

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device, whole: bool) -> None:
        self.layout, self.whole = layout, whole
        #: the model's flat parameter buffer (empty when the parameters are not flattened)
        self.param_flat = torch.empty(0)
        #: per trainable piece (by id), its elements of the model: fixed views, made with the pieces (a step
        #: writes through them without asking the layout again)
        self._regions: dict[int, torch.Tensor] = {}
        if not whole:
            self._flatten(dtype, device)

    def _flatten(self, dtype: torch.dtype, device: torch.device) -> None:
        """Move every trainable parameter into one flat buffer of ``dtype`` (they become views of it)."""
        layout = self.layout
        self.param_flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
        for index, param in enumerate(layout.params):
            view = layout.param_slice(self.param_flat, index)
            view.copy_(param.detach().reshape(-1))
            param.data = view.view_as(param)

    def pieces(self, names: dict[int, str], groups: dict[int, int], frozen: Sequence[nn.Parameter]) -> list[Piece]:
        """The store's pieces: this rank's part of each trainable parameter, in shard order, then each frozen
        parameter whole."""
        layout, pieces = self.layout, []
        for run in layout.pieces:
            param = layout.params[run.param]
            pieces.append(Piece(param, names[id(param)], param.shape, run.start, run.end, run.shard_offset,
                                groups[id(param)], run.param))
            if not self.whole:  # (whole: the parameter itself, which may not be contiguous, so not viewed flat)
                self._regions[id(pieces[-1])] = self._region(pieces[-1])
        for param in frozen:
            pieces.append(Piece(param, names[id(param)], param.shape, 0, param.numel(), -1, groups[id(param)], -1))
        return pieces

    def view(self, piece: Piece) -> Optional[torch.Tensor]:
        if piece.at < 0:
            return None  # frozen: its master is kept apart, whole
        return piece.param if self.whole else self._region(piece)

    def _region(self, piece: Piece) -> torch.Tensor:
        """The piece's elements of the model's parameter (in the flat buffer where it was flattened)."""
        if piece.at < 0 or self.whole:
            return piece.param.detach().view(-1).narrow(0, piece.start, piece.numel)
        return self.layout.param_slice(self.param_flat, piece.index).narrow(0, piece.start, piece.numel)

    def values(self, piece: Piece) -> torch.Tensor:
        return piece.param.detach().reshape(-1).narrow(0, piece.start, piece.numel).to(torch.float32, copy=True)

    def free_values(self) -> None:
        """Free the flat buffer's memory until the next :meth:`write` (its views stay, sized 0)."""
        self.param_flat.untyped_storage().resize_(0)

    def restore_values(self) -> None:
        """The flat buffer's memory back after :meth:`free_values`, its bucket padding zeroed (nothing else kept:
        the caller writes every piece, and the all-gather the other ranks' slices)."""
        flat = self.param_flat
        storage = flat.untyped_storage()
        if storage.nbytes() == 0 and flat.numel():
            storage.resize_(flat.numel() * flat.element_size())
            for bucket in self.layout.buckets:
                flat.narrow(0, bucket.flat_offset + bucket.numel, bucket.padded - bucket.numel).zero_()

    def write(self, runs: Runs, last: bool = False) -> None:
        """Into this rank's slice of the flat buffer (then all-gathered), or a frozen parameter itself."""
        self.restore_values()
        regions = self._regions
        for piece, at, values in runs:
            region = regions.get(id(piece))
            target = (region if region is not None else self._region(piece)).narrow(0, at, values.numel())
            if target.data_ptr() != values.data_ptr():
                target.copy_(values, non_blocking=True)  # from pinned staging (host offload): not waited for

    def settle(self) -> None:
        pass  # nothing is held between writes

    def gather_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per bucket: (the model's region of it, this rank's slice inside that region), fixed views; none with
        one shard (the step wrote every parameter).  After the step this rank's slice holds its updated values,
        so an all-gather of each pair, in place, re-assembles the updated parameters."""
        layout, flat = self.layout, self.param_flat
        if self.whole or layout.num_shards == 1:
            return []
        return [(layout.bucket_slice(flat, b), layout.owned_slice(flat, b)) for b in layout.buckets]

    def release(self) -> None:
        """Give every parameter its own storage again (before the layout is rebuilt)."""
        if not self.whole:
            for param in self.layout.params:
                param.data = param.data.clone()


def export_state(layout: FlatLayout, store: MasterStore, state: MutableMapping[Any, Any], comm: Comm,
                 gather_flat: Callable[[torch.Tensor], torch.Tensor], whole: bool, device: torch.device) -> dict[int, Kept]:
    """Full master and optimizer state of every parameter in ``layout`` (collective, gathered on ``device``),
    taken out of the inner optimizer's ``state``, before the layout is rebuilt for a new trainable set (a rank
    may own other element ranges after it; :meth:`.MasterStore.adopt` slices out its new pieces, and a parameter
    that stopped training keeps its full entry in the :class:`~..store.store.FrozenStore`).  One all-gather per
    state kind; ``whole``: every rank steps the parameters themselves (stage 0 in fp32), whose entries are then
    the parameters' own values, nothing gathered or copied."""
    store.home.check_whole("change the trainable set")
    pieces = [piece for piece in store.pieces if piece.key is not None]  # in the order of layout.pieces
    local = {run.param: store.home.slot(piece, state).get() for run, piece in zip(layout.pieces, pieces)}
    if whole:
        result = {id(p.param): Kept(0, p.numel, p.param.detach().view(-1), KeptSlot(local[p.index])) for p in pieces}
        state.clear()
        return result
    scalars, names = _scalars(layout, local, comm)
    master = store.shard(layout.shard_numel, device)
    full = gather_flat(master)
    result = {}
    for index, param in enumerate(layout.params):
        result[id(param)] = Kept(0, param.numel(), layout.param_slice(full, index).clone(), KeptSlot(dict(scalars[index])))
    for name in sorted({n for per_param in names for n in per_param}):
        shard = torch.zeros_like(master)
        for run in layout.pieces:
            value = local[run.param].get(name)
            if value is not None:
                shard.narrow(0, run.shard_offset, run.numel).copy_(value.reshape(-1))
        full = gather_flat(shard)
        for index, param in enumerate(layout.params):
            if name in names[index]:
                result[id(param)].state[name] = layout.param_slice(full, index).clone()
    state.clear()
    return result


def _scalars(layout: FlatLayout, local: dict[int, dict[str, Any]],
             comm: Comm) -> tuple[list[dict[str, Any]], list[list[str]]]:
    """Per parameter: its non-per-element state, and the names of its per-element tensors.  Every piece of a parameter
    is stepped together, so whichever rank owns a piece can speak for the whole parameter; one ``all_gather_object``
    shares it.
    """
    mine: dict[int, tuple[dict[str, Any], list[str]]] = {}
    for run in layout.pieces:
        entries = local[run.param]
        if entries:
            mine[run.param] = (
                {k: copy_value(v) for k, v in entries.items() if not is_per_element(v, run.numel)},
                sorted(k for k, v in entries.items() if is_per_element(v, run.numel)),
            )
    scalars: list[dict[str, Any]] = [{} for _ in layout.params]
    names: list[list[str]] = [[] for _ in layout.params]
    for gathered in comm.all_gather_object(mine):
        for index, (values, per_element) in gathered.items():
            scalars[index], names[index] = values, per_element
    return scalars, names


# ------------------------------------------------ the gathers behind the next forward
#: where a parameter in flight keeps (its PendingGathers, its bucket index)
_KEY = "_shardwise_gathering"


def _attribute(name: str) -> Any:
    """The descriptor behind ``Tensor.<name>``: what ``__torch_function__`` receives as ``func``."""
    return inspect.getattr_static(torch.Tensor, name)


#: what reads or sets a parameter's bookkeeping, not its values: these run without waiting
#: (``zero_grad`` and the trainable-set check touch every parameter while gathers are in flight)
_NOT_A_USE = frozenset({_attribute("grad").__get__, _attribute("grad").__set__, _attribute("requires_grad").__get__})


class GatheringParameter(nn.Parameter):
    """A parameter whose bucket's all-gather is still in flight (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Optional[dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if func not in _NOT_A_USE:
            for param in _in_flight(args, kwargs):
                param._arrive()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def _arrive(self) -> None:
        """Wait for this parameter's bucket (it and its bucket become plain Parameters)."""
        entry = self.__dict__.get(_KEY)
        if entry is not None:
            entry[0].wait_bucket(entry[1])

    # A copy or a pickle of a parameter in flight is of the arrived value, and a plain Parameter.
    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Parameter:
        self._arrive()
        return nn.Parameter.__deepcopy__(self, memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        self._arrive()
        return nn.Parameter.__reduce_ex__(self, protocol)


def _in_flight(args: Any, kwargs: dict[str, Any]) -> Iterator[GatheringParameter]:
    stack = [*args, *kwargs.values()]
    while stack:
        item = stack.pop()
        if type(item) is GatheringParameter:
            yield item
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


class PendingGathers:
    """The buckets whose all-gather was started and not yet waited for, with their parameters."""

    def __init__(self) -> None:
        #: per bucket in flight, its gather and its parameters (empty: nothing to wait for)
        self.works: dict[int, tuple[Work, list[torch.Tensor]]] = {}

    def start(self, gathers: Sequence[tuple[int, Work, list[torch.Tensor]]]) -> None:
        """Each ``(index, work, params)``: bucket ``index`` is being gathered by ``work`` into ``params``; guard
        them until it is done (one call for a step's buckets)."""
        for index, work, params in gathers:
            if any(type(p) is not nn.Parameter for p in params):
                work.wait()  # a Parameter subclass of the user's keeps its class: no overlap for its bucket
                continue
            self.works[index] = (work, params)
            for param in params:
                param.__dict__[_KEY] = (self, index)
                param.__class__ = GatheringParameter

    def wait_bucket(self, index: int) -> None:
        """Finish bucket ``index``'s gather (nothing if it is done); its parameters become plain again."""
        entry = self.works.pop(index, None)
        if entry is None:
            return
        work, params = entry
        _plain(params)
        work.wait()

    def wait_all(self) -> None:
        """Finish every gather in flight, in the order they were started."""
        entries, self.works = list(self.works.values()), {}
        for _, params in entries:
            _plain(params)
        wait_all([work for work, _ in entries])


def _plain(params: list[torch.Tensor]) -> None:
    """The parameters of a bucket whose gather is waited for become plain ``nn.Parameter`` s again."""
    for param in params:
        param.__class__ = nn.Parameter
        param.__dict__.pop(_KEY, None)
