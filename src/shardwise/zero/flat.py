"""Flat-bucket strategies (stages 0, 1 and 2): full parameters on every rank.

What the three stages share lives here: the :class:`~.layout.FlatLayout`,
the optimizer step over this rank's masters, the all-gather of the updated
slices behind the next forward, and carrying state across a change of the
trainable set.  Where gradients live is the stage's
:attr:`FlatStrategy.grad_storage` (:mod:`.grads`), built once per layout with
the allocator the transport offers: each parameter's post-accumulate hook is
the storage's, which launches a complete bucket itself.  The masters'
arrangement is chosen beside it (:mod:`.masters`).  A stage differs only in how
it reduces (its ``_reduction``) and which storage it uses:

* stage 0 (:mod:`.stage0`): one shard; each bucket is all-reduced, and the
  step writes every parameter itself; a flat gradient buffer;
* stage 1 (:mod:`.stage1`): N shards; each bucket is reduce-scattered and the
  updated slices are all-gathered; a flat gradient buffer;
* stage 2 (:mod:`.stage2`): as stage 1, with gradients staged per bucket at
  the boundary instead of living in a full-size buffer.

A bucket is launched once all of its parameters' gradients are in *and* every
earlier bucket has been launched, so all ranks issue the same collectives in
the same order even when their autograd orders differ.
"""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from typing import Any, Iterator, Optional

import torch
from torch import nn

from ..param_state import ParamShard
from .base import Strategy, group_index, module_order, tensor_bytes
from .grads import Allocate, FlatGrads, GradStorage, Reduce, private_zeros
from .layout import FlatLayout
from .masters import Masters, ParamsAreMasters, choose_masters
from .pending import PendingGathers
from .store.frozen import FrozenStore, Kept
from .store.plan import offload_spec
from .weak_hooks import WeakHook, remove_with

__all__ = ["FlatStrategy"]


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
        # empty until `attach` builds them (inference: they stay empty)
        self.layout = FlatLayout([], 1, 1, 0)
        self.grads: GradStorage = self._storage(private_zeros)
        self.masters: Masters = ParamsAreMasters(self.layout, self.precision.dtype, self.device)
        self.frozen = FrozenStore()
        #: per parameter id, the fp32 tensor the inner optimizer steps
        self.steps: dict[int, torch.Tensor] = {}
        #: per bucket, (the model's region of it, this rank's updated slice inside it): what the step
        #: all-gathers (empty with one shard: the step wrote every parameter)
        self._gathers: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: updated parameters still being gathered; waited for on first use (:mod:`.pending`)
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

    def _num_shards(self) -> int:
        return self.comm.world_size

    # ------------------------------------------------------------------ build
    def attach(self, inner: Optional[Any], initial: Optional[dict[int, torch.Tensor]] = None) -> None:
        super().attach(inner, initial)
        if inner is None:
            return
        self._groups = [list(group["params"]) for group in inner.param_groups]
        self._order = module_order(self.module, self._groups)
        self._build(self.initial)
        self.initial = {}  # only needed once: let the fp32 originals go

    def _build(self, initial: dict[int, torch.Tensor]) -> None:
        params = [p for p in self._order if p.requires_grad]
        self._mask = tuple(p.requires_grad for p in self._order)
        rank = self.comm.rank if self.num_shards > 1 else 0
        self.layout = FlatLayout(params, self.zero_config.reduce_bucket_size, self.num_shards, rank)
        self.device = params[0].device if params else torch.device("cpu")
        self.grads = self._storage(self._allocator())
        offload = offload_spec(self.zero_config, self.comm.rank, self.inner)
        self.masters = choose_masters(self.layout, self.precision.dtype, self.device, self.grads, offload)
        self.masters.build(initial)
        self.steps = self.masters.steps(self.grads.reduced)
        self._uncounted = self._reduced_grads_of(self._elsewhere)
        # fixed views for the life of this layout; one shard: the step wrote every parameter, nothing to gather
        self._gathers = self.masters.gather_pairs() if self.layout.num_shards > 1 else []
        for group, originals in zip(self.inner.param_groups, self._groups):
            group["params"] = [self.steps[id(p)] for p in originals if id(p) in self.steps]
        # straight to the storage (no stop here on the way), held weakly: a dropped engine is freed (:mod:`.weak_hooks`)
        hooks = [param.register_post_accumulate_grad_hook(WeakHook(self.grads.on_grad, index))
                 for index, param in enumerate(self.layout.params)]
        self._hooks.extend(hooks)
        remove_with(self.grads, hooks)
        self._unused = []

    def _storage(self, allocate: Allocate) -> GradStorage:
        return self.grad_storage(self.layout, self.precision.dtype, self.device, allocate, self.backward,
                                 self._reduction(), self.precision.reduce_dtype)

    def _allocator(self) -> Allocate:
        """Memory every rank maps when collectives go through shared memory (a reduction then reads the
        peers' gradients in place), else this process's own; the same choice on every rank."""
        return self.comm.shm.zeros if self.comm.shm.active else private_zeros

    # --------------------------------------------------------------- backward
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
        used = torch.tensor(self.grads.finish(), dtype=torch.float32, device=self.device)
        # DDP's `find_unused_parameters`: torch's optimizers leave a parameter whose `.grad` is None alone (no
        # momentum, no weight decay), and so does the step here for one no rank had a gradient for
        self.comm.all_reduce(used, label="which parameters had gradients")
        self._unused = (used == 0).nonzero().view(-1).tolist()

    @contextlib.contextmanager
    def adding_to_reduced(self) -> Iterator[None]:
        """A second reducing backward before the step: this rank's reduced gradients are kept aside, the
        gradients cleared (so the next ones overwrite the buffer), and the kept ones added to the new
        reduction; a parameter either backward used counts as used."""
        self.settle()
        kept = [grad.clone() for grad in self.grads.reduced.slices]
        unused = set(self._unused)
        self.zero_grad()
        yield
        for grad, earlier in zip(self.grads.reduced.slices, kept):
            grad.add_(earlier)
        self._unused = sorted(unused & set(self._unused))

    @contextlib.contextmanager
    def _leaving_unused_alone(self) -> Iterator[None]:
        """While the optimizer steps: the parameters no rank had a gradient for have ``.grad`` None.

        The model's own ``.grad`` stays None afterwards, as DDP leaves a globally unused parameter's.
        """
        hidden: list[tuple[torch.Tensor, Optional[torch.Tensor]]] = []
        for index in self._unused:
            param = self.layout.params[index]
            param.grad = None  # not a use of the values (see .pending)
            step = self.steps.get(id(param))
            if step is not None and step is not param:
                hidden.append((step, step.grad))
                step.grad = None
        try:
            yield
        finally:
            for step, grad in hidden:
                step.grad = grad

    # ------------------------------------------------------------------- step
    def step_sums(self) -> torch.Tensor:
        """This rank's sum of squared reduced gradients (taken while the reduction was waited for); the
        "had a gradient" flags were summed at the end of backward, where DDP leaves unused ``.grad`` None."""
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
        if factor != 1.0:
            self.grads.reduced.scale(factor)
        with self._leaving_unused_alone():
            self.masters.step(inner)  # steps (an offloaded arrangement a sub-group at a time) and publishes
        if release:
            self._forget_grads()
        self._regather()

    def sync_params_from_master(self) -> None:
        self.settle()
        self.masters.publish()
        self._regather()

    def _regather(self) -> None:
        """Start the all-gather of every bucket's updated slice, in forward order, and return.

        The last bucket holds the first layers (buckets follow backward order), so it goes first.
        """
        params = self.layout.params
        for bucket, (region, owned) in reversed(list(zip(self.layout.buckets, self._gathers))):
            work = self.comm.all_gather(region, owned, async_op=True, label=f"parameters, bucket {bucket.index}")
            self.pending.start(bucket.index, work, [params[i] for i in bucket.params])

    def settle(self) -> None:
        self.pending.wait_all()

    def zero_grad(self) -> None:
        """Gradients become None, as torch's default; the storage is overwritten, not zeroed (:mod:`.grads`)."""
        self._forget_grads()

    def _forget_grads(self) -> None:
        self._dirty = False
        for param in self.layout.params:
            param.grad = None  # not a use of the values: no wait for a gather in flight (see .pending)

    def has_pending_grads(self) -> bool:
        return self._dirty

    def trained_count(self) -> int:
        return len(self.layout.params)

    # ------------------------------------------------------------ trainability
    def trainable_changed(self) -> bool:
        # Reading flags is not a use of the values: it does not wait for a gather in flight (see .pending).
        return self.inner is not None and tuple(p.requires_grad for p in self._order) != self._mask

    def refresh_trainable(self) -> None:
        """Rebuild layout, buffers, hooks and optimizer pieces for the current ``requires_grad`` flags.

        Master weights and optimizer state move with their parameters; a
        parameter that stops training keeps them in the frozen store.
        """
        if self.inner is None:
            return
        self.settle()
        carried = self.masters.export(self.inner.state, self.steps, self.comm, self.gather_flat)
        self.close()
        for param in self.layout.params:
            param.grad = None
        self.masters.release()
        self._build({})
        for param in self.layout.params:
            kept = self.frozen.take(param)
            if kept is not None:
                carried.setdefault(id(param), kept)
        self.masters.adopt(carried, self.inner.state, self.steps)
        training = {id(p) for p in self.layout.params}
        for param in self._order:
            if id(param) not in training and id(param) in carried:
                self.frozen.keep(param, carried[id(param)])

    # -------------------------------------------------------------- checkpoint
    @contextlib.contextmanager
    def checkpoint_shards(self, loading: bool, wanted: frozenset[str] = frozenset()) -> Iterator[list[ParamShard]]:
        self.settle()
        if self.inner is None:
            yield []
            return
        names = {id(p): n for n, p in self.module.named_parameters()}
        groups = group_index(self._groups)
        training = {id(p) for p in self.layout.params}
        frozen = [p for p in self._order if id(p) not in training]
        if not loading:
            yield self._shards(names, groups) + self.frozen.shards(frozen, names, groups)
            return
        with self.frozen.loading(frozen, lambda p: names[id(p)] in wanted, _whole, _write_whole):
            yield self._shards(names, groups) + self.frozen.shards(frozen, names, groups)

    def _shards(self, names: dict[int, str], groups: dict[int, int]) -> list[ParamShard]:
        shards = []
        for index, piece in enumerate(self.layout.pieces):
            param = self.layout.params[piece.param]
            master, slot = self.masters.piece(index, self.steps[id(param)], self.inner.state)
            shards.append(ParamShard(names[id(param)], param.shape, piece.start, piece.end, master,
                                     groups[id(param)], slot))
        return shards

    # ------------------------------------------------------------ accounting
    def memory_breakdown(self) -> dict[str, int]:
        params = {id(p): p for p in self.module.parameters()}
        state = getattr(self.inner, "state", {}) if self.inner is not None else {}
        kept_masters = self.frozen.master_bytes() if self.masters.owns_copies else 0
        return {
            "parameters": tensor_bytes(list(params.values())),
            "master_weights": self.masters.nbytes() + kept_masters,
            "gradients": self.grads.nbytes(),
            "optimizer_state": tensor_bytes(list(state.values())) + self.frozen.state_bytes()
            + self.masters.state_nbytes(),
        }

    def full_master_weights(self) -> dict[int, torch.Tensor]:
        self.settle()
        if self.inner is None:
            return {}
        result = self.masters.full(self.gather_flat)
        # frozen parameters keep their fp32 master in the store until they train again
        for param in self._order:
            kept = self.frozen.get(param)
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
        self.masters.close()


def _whole(param: torch.Tensor) -> Kept:
    """A frozen parameter's entry, whole, from its current value (it may receive loaded state)."""
    return Kept(0, param.numel(), param.detach().float().reshape(-1).clone())


def _write_whole(param: torch.Tensor, kept: Kept) -> None:
    flat = param.detach().view(-1)
    if flat.data_ptr() != kept.master.data_ptr():
        flat.copy_(kept.master)
