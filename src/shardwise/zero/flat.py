"""Flat-bucket strategies (stages 0, 1 and 2): full parameters on every rank.

What the three stages share lives here: the :class:`~.layout.FlatLayout`, fp32
master weights for the slice this rank owns, gradient buckets reduced
asynchronously from autograd hooks while backward is still running, and the
re-gather of updated parameters.  The stage classes only choose

* ``num_shards``: 1 (stage 0, every rank owns everything) or the world size;
* ``persistent_grads``: whether full-size gradients live in a flat buffer that
  ``param.grad`` views into (stages 0, 1), or are copied into a bucket and
  released as soon as they are produced (stage 2).

A bucket is launched once all of its parameters' gradients are in *and* every
earlier bucket has been launched, so all ranks issue the same collectives in
the same order even when their autograd orders differ.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch import nn

from .base import ParamShard, Strategy, module_order, tensor_bytes
from .carry import ParamState, export_state, import_state
from .layout import Bucket, FlatLayout

__all__ = ["FlatStrategy"]


class FlatStrategy(Strategy):
    """Base of stages 0-2; see the module docstring."""

    persistent_grads: bool = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.num_shards = self._num_shards()
        self.shards_grads = self.num_shards > 1
        # Gradients are averaged by pre-dividing the loss (see Strategy.loss_divisor).
        self.loss_divisor = float(self.comm.world_size)
        self.layout = FlatLayout([], 1, 1, 0)  # empty until `attach` builds it (inference: stays empty)
        self.device = torch.device("cpu")
        self._hooks: list[Any] = []
        self._groups: list[list[nn.Parameter]] = []
        self._mask: tuple[bool, ...] = ()
        # in flight: (work, bucket, its full-size fp32 source, the shard slice to fill after the
        # wait, when an all-reduce stands in for the reduce-scatter)
        self._works: list[tuple[Any, Bucket, torch.Tensor, Optional[torch.Tensor]]] = []
        # Contiguous fp32 shards, or None where the owned slices of the model's own
        # flat buffers serve (fp32 training needs no separate copy).
        self.master: Optional[torch.Tensor] = None
        self.master_grad: Optional[torch.Tensor] = None
        self._master_slices: list[torch.Tensor] = []  # per bucket, this rank's master slice
        self._grad_slices: list[torch.Tensor] = []  # per bucket, this rank's reduced-gradient slice
        self.param_flat = torch.empty(0)
        self.grad_flat = torch.empty(0)
        self._grad_views: list[torch.Tensor] = []
        self._dirty = False
        self._stash: dict[int, ParamState] = {}
        self._extra_shards: list[ParamShard] = []  # frozen parameters, while a checkpoint_view is open

    def _num_shards(self) -> int:
        return self.comm.world_size

    # ------------------------------------------------------------------ build
    def attach(self, inner: Optional[Any], initial: Optional[dict[int, torch.Tensor]] = None) -> None:
        super().attach(inner, initial)
        if inner is None:
            return
        self._groups = [list(group["params"]) for group in inner.param_groups]
        self._order = module_order(self.module, self._groups)
        self._build()

    @property
    def alias(self) -> bool:
        """One shard, fp32, persistent gradients (stage 0, or stage 1 on one rank):
        the model's parameters are the master weights and their gradients the master gradients."""
        return self.num_shards == 1 and self.precision.dtype == torch.float32 and self.persistent_grads

    def _build(self) -> None:
        params = [p for p in self._order if p.requires_grad]
        self._mask = tuple(p.requires_grad for p in self._order)
        self.layout = FlatLayout(
            params,
            self.zero_config.reduce_bucket_size,
            self.num_shards,
            self.comm.rank if self.num_shards > 1 else 0,
        )
        self.device = device = params[0].device if params else torch.device("cpu")
        if not self.alias:
            self._flatten_params(device)
        self._make_grad_storage(device)
        self._point_optimizer()
        self._register_hooks()
        self._reset_backward()

    def _flatten_params(self, device: torch.device) -> None:
        layout = self.layout
        dtype = self.precision.dtype
        self.param_flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
        for index, param in enumerate(layout.params):
            view = layout.param_slice(self.param_flat, index)
            view.copy_(param.detach().reshape(-1))
            param.data = view.view_as(param)
        if dtype == torch.float32:
            # fp32: this rank's slice of the parameter buffer is the master; the
            # all-gather after the step runs in place.
            self.master = None
            self._master_slices = [layout.owned_slice(self.param_flat, b) for b in layout.buckets]
        else:
            self.master = torch.zeros(layout.shard_numel, dtype=torch.float32, device=device)
            self._master_slices = [layout.shard_slice(self.master, b) for b in layout.buckets]
            for piece in layout.pieces:
                param = layout.params[piece.param]
                source = self.initial.get(id(param), param.data).reshape(-1)
                self.master.narrow(0, piece.shard_offset, piece.numel).copy_(source[piece.start : piece.end])
        self.initial = {}  # only needed once: let the fp32 originals go

    def _make_grad_storage(self, device: torch.device) -> None:
        layout = self.layout
        if self.persistent_grads:
            self.grad_flat = torch.zeros(layout.padded_numel, dtype=self.precision.dtype, device=device)
            # each parameter's gradient view, built once: the hooks compare against it every backward
            self._grad_views = [
                layout.param_slice(self.grad_flat, i).view_as(p) for i, p in enumerate(layout.params)
            ]
            self._restore_grad_views()
        if self.alias:
            self.master_grad = self.grad_flat
            self._grad_slices = [layout.shard_slice(self.grad_flat, b) for b in layout.buckets]
        elif self.persistent_grads and self.precision.dtype == torch.float32:
            # stage 1 in fp32: reduce-scatter in place; this rank's slice of the
            # full gradient buffer receives the averaged gradient it steps with.
            self.master_grad = None
            self._grad_slices = [layout.owned_slice(self.grad_flat, b) for b in layout.buckets]
        else:
            self.master_grad = torch.zeros(layout.shard_numel, dtype=torch.float32, device=device)
            self._grad_slices = [layout.shard_slice(self.master_grad, b) for b in layout.buckets]

    def _restore_grad_views(self) -> None:
        for param, view in zip(self.layout.params, self._grad_views):
            param.grad = view

    def _point_optimizer(self) -> None:
        """Make the inner optimizer step this rank's fp32 master pieces."""
        if self.alias:
            return  # the model's own parameters are stepped, as in plain DDP
        views: dict[int, torch.Tensor] = {}
        for piece in self.layout.pieces:
            bucket, _ = self.layout.bucket_of[piece.param]
            at = piece.shard_offset - bucket.shard_offset
            view = self._master_slices[bucket.index].narrow(0, at, piece.numel)
            view.grad = self._grad_slices[bucket.index].narrow(0, at, piece.numel)
            views.setdefault(id(self.layout.params[piece.param]), view)
        for group, originals in zip(self.inner.param_groups, self._groups):
            group["params"] = [views[id(p)] for p in originals if id(p) in views]
        self.piece_views = views

    def _register_hooks(self) -> None:
        for index, param in enumerate(self.layout.params):
            hook = param.register_post_accumulate_grad_hook(self._hook_for(index))
            self._hooks.append(hook)

    def _hook_for(self, index: int) -> Any:
        def on_grad(param: torch.Tensor) -> None:
            self._on_grad(index, param)

        return on_grad

    # --------------------------------------------------------------- backward
    def _reset_backward(self) -> None:
        self._pending = [len(b.params) for b in self.layout.buckets]
        self._seen = [False] * len(self.layout.params)
        self._next = 0
        self._works = []

    def start_backward(self, sync: bool) -> None:
        self.sync = sync
        self._dirty = True
        self._reset_backward()

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        if self.persistent_grads:
            self._keep_grad_in_buffer(index, param)
        if not self.sync or self._seen[index]:
            return
        self._seen[index] = True
        self._take_grad(index, param)
        bucket, _ = self.layout.bucket_of[index]
        self._pending[bucket.index] -= 1
        self._launch_ready()

    def _keep_grad_in_buffer(self, index: int, param: torch.Tensor) -> None:
        # A user's `model.zero_grad()` sets .grad to None, so autograd allocated a
        # fresh tensor: fold it back into the flat buffer the reduction reads.
        view = self._grad_views[index]
        if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
            view.add_(param.grad)
            param.grad = view

    def _take_grad(self, index: int, param: torch.Tensor) -> None:
        """Stage-specific: capture ``param``'s gradient for its bucket."""

    def _launch_ready(self) -> None:
        buckets = self.layout.buckets
        while self._next < len(buckets) and self._pending[self._next] == 0:
            self._launch(buckets[self._next])
            self._next += 1

    def _comm_input(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's summed local gradients as a full-size fp32 tensor."""
        region = self.layout.bucket_slice(self.grad_flat, bucket)
        return region if region.dtype == torch.float32 else region.float()

    def _launch(self, bucket: Bucket) -> None:
        output = self._grad_slices[bucket.index]
        source = self._comm_input(bucket)
        pending: Optional[torch.Tensor] = None
        if self.num_shards == 1:
            if source.data_ptr() != output.data_ptr():
                output.copy_(source)
            work = self.comm.all_reduce(output, async_op=True)
        elif not self.zero_config.reduce_scatter:
            # DeepSpeed's `reduce_scatter: false`: average with an all-reduce (twice the
            # bytes, but faster than gloo's reduce-scatter on CPU), keep the owned slice.
            work = self.comm.all_reduce(source, async_op=True)
            pending = output
        else:
            work = self.comm.reduce_scatter(output, source, async_op=True)
        self._works.append((work, bucket, source, pending))

    def finish_backward(self) -> None:
        if not self.sync:
            return
        for bucket in self.layout.buckets[self._next :]:
            self._flush(bucket)
            self._launch(bucket)
        self._next = len(self.layout.buckets)
        for work, bucket, source, pending in self._works:
            work.wait()
            if pending is not None:
                owned = source.narrow(0, self.layout.rank * bucket.shard_numel, bucket.shard_numel)
                if owned.data_ptr() != pending.data_ptr():
                    pending.copy_(owned)
        self._works = []

    def _flush(self, bucket: Bucket) -> None:
        """Stage-specific: capture gradients whose hooks did not fire (unused parameters)."""

    # ------------------------------------------------------------------- step
    def grad_sq(self) -> torch.Tensor:
        if self.master_grad is not None:  # contiguous: one kernel
            grad = self.master_grad.float()
            return torch.dot(grad, grad) if grad.numel() else grad.new_zeros(())
        total = torch.zeros((), dtype=torch.float32)
        for grad in self._grad_slices:
            total += torch.dot(grad, grad)
        return total

    def scale_grads(self, factor: float) -> None:
        if factor != 1.0:
            self._scale_slices(factor)

    def _scale_slices(self, factor: float) -> None:
        if self.master_grad is not None:
            self.master_grad.mul_(factor)
        else:
            for grad in self._grad_slices:
                grad.mul_(factor)

    def after_step(self) -> None:
        if self.alias:
            return
        layout, dtype = self.layout, self.precision.dtype
        if self.num_shards == 1:
            if self.master is not None:
                self.param_flat.copy_(self.master)
            return
        works = []
        for bucket in layout.buckets:
            source = self._master_slices[bucket.index]  # in fp32 a slice of the output: gathered in place
            source = source if dtype == torch.float32 else source.to(dtype)
            works.append(self.comm.all_gather(layout.bucket_slice(self.param_flat, bucket), source, async_op=True))
        for work in works:
            work.wait()

    def zero_grad(self) -> None:
        self._dirty = False
        if self.persistent_grads:
            self.grad_flat.zero_()
            self._restore_grad_views()
        else:
            for param in self.layout.params:
                param.grad = None

    def has_pending_grads(self) -> bool:
        return self._dirty

    # ------------------------------------------------------------ trainability
    def trainable_changed(self) -> bool:
        return self.inner is not None and tuple(p.requires_grad for p in self._order) != self._mask

    def refresh_trainable(self) -> None:
        """Rebuild layout, buffers, hooks and optimizer pieces for the current ``requires_grad`` flags.

        Master weights and optimizer state move with their parameters; a
        parameter that stops training keeps its state for when it resumes.
        """
        if self.inner is None:
            return
        carried: dict[int, ParamState] = {}
        if not self.alias:
            exported = export_state(
                self.layout, self._master_shard(), self.piece_views, self.inner.state, self.comm, self.gather_flat
            )
            carried = {**self._stash, **exported}
            self.inner.state.clear()
        self.close()
        for param in self.layout.params:
            param.grad = None
            if not self.alias:
                param.data = param.data.clone()  # let go of the old flat buffer
        self._build()
        if not self.alias:
            import_state(self.layout, self.piece_views, self.inner.state, carried)
            training = {id(p) for p in self.layout.params}
            self._stash = {k: v for k, v in carried.items() if k not in training}

    @contextlib.contextmanager
    def checkpoint_view(self, loading: bool, wanted: frozenset[str] = frozenset()) -> Iterator[None]:
        if self.inner is None:
            yield
            return
        names = {id(p): n for n, p in self.module.named_parameters()}
        group_of = {id(p): g for g, params in enumerate(self._groups) for p in params}
        frozen = [p for p in self._order if not p.requires_grad]
        if loading:
            frozen = [p for p in frozen if names[id(p)] in wanted]
        if self.alias:  # their state is keyed by the parameter itself, as for trainable ones
            state = self.inner.state
            listed = [p for p in frozen if loading or state.get(p)]
            self._extra_shards = [
                ParamShard(names[id(p)], p.shape, 0, p.numel(), p.data.view(-1), p, group_of[id(p)]) for p in listed
            ]
            try:
                yield
            finally:
                self._extra_shards = []
            return
        entries = self._open_stash(frozen, loading)
        keys = self._expose_stash(entries, names, group_of)
        try:
            yield
        except BaseException:
            self._close_stash(entries, keys)
            raise
        self._close_stash(entries, keys)
        if loading:
            self._adopt_loaded_stash(entries)

    def _open_stash(self, frozen: list[nn.Parameter], loading: bool) -> dict[int, ParamState]:
        entries = dict(self._stash)
        if loading:  # a frozen parameter may receive state: give it a (temporary) entry
            for param in frozen:
                entries.setdefault(
                    id(param), {"master": param.detach().float().reshape(-1).clone(), "tensors": {}, "scalars": {}}
                )
        return entries

    def _expose_stash(
        self, entries: dict[int, ParamState], names: dict[int, str], group_of: dict[int, int]
    ) -> dict[int, torch.Tensor]:
        """Rank 0 lists each kept entry as one whole-parameter shard (the stash is replicated)."""
        keys: dict[int, torch.Tensor] = {}
        if self.comm.rank != 0:
            return keys
        shapes = {id(p): p.shape for p in self._order}
        for pid, entry in entries.items():
            key = keys[pid] = entry["master"]
            self.inner.state[key] = {**{k: v.clone() for k, v in entry["tensors"].items()}, **entry["scalars"]}
            self._extra_shards.append(ParamShard(names[pid], shapes[pid], 0, key.numel(), key, key, group_of[pid]))
        return keys

    def _close_stash(self, entries: dict[int, ParamState], keys: dict[int, torch.Tensor]) -> None:
        self._extra_shards = []
        for pid, key in keys.items():
            state = self.inner.state.pop(key, {})
            tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == key.numel()}
            entries[pid]["tensors"] = tensors
            entries[pid]["scalars"] = {k: v for k, v in state.items() if k not in tensors}

    def _adopt_loaded_stash(self, entries: dict[int, ParamState]) -> None:
        """Share rank 0's loaded entries: every listed parameter takes its loaded value;
        those that carry optimizer state keep their entry (collective).

        The layout of each entry goes as one small object; the tensors as broadcasts.
        """
        position = {id(p): i for i, p in enumerate(self._order)}  # ids differ between processes
        layout = None
        if self.comm.rank == 0:
            layout = {
                position[pid]: (
                    {k: (v.numel(), v.dtype) for k, v in e["tensors"].items()},
                    e["scalars"],
                )
                for pid, e in entries.items()
            }
        layout = self.comm.broadcast_object(layout)
        self._stash = {}
        for index in sorted(layout):
            param = self._order[index]
            shapes, scalars = layout[index]
            entry = entries.get(id(param)) if self.comm.rank == 0 else None
            master = entry["master"] if entry else torch.empty(param.numel(), dtype=torch.float32, device=param.device)
            self.comm.broadcast(master, src=0)
            tensors = {}
            for name, (numel, dtype) in shapes.items():
                value = entry["tensors"][name] if entry else torch.empty(numel, dtype=dtype, device=param.device)
                self.comm.broadcast(value, src=0)
                tensors[name] = value
            param.data.copy_(master.view(param.shape))
            if tensors or scalars:
                self._stash[id(param)] = {"master": master, "tensors": tensors, "scalars": scalars}

    # ------------------------------------------------------------ accounting
    def memory_breakdown(self) -> dict[str, int]:
        params = {id(p): p for p in self.module.parameters()}
        grads = [self.grad_flat, None if self.alias else self.master_grad]
        master = None if self.alias else self.master
        state = getattr(self.inner, "state", {}) if self.inner is not None else {}
        return {
            "parameters": tensor_bytes(list(params.values())),
            "master_weights": tensor_bytes(master) if master is not None else 0,
            "gradients": tensor_bytes([g for g in grads if g is not None]),
            "optimizer_state": tensor_bytes(list(state.values())),
        }

    def full_master_weights(self) -> dict[int, torch.Tensor]:
        if self.inner is None:
            return {}
        layout = self.layout
        if self.alias:
            return {id(p): p.detach().float().clone() for p in layout.params}
        full = self.param_flat.float() if self.master is None else self.gather_flat(self.master)
        result = {id(p): layout.param_slice(full, i).view_as(p).clone() for i, p in enumerate(layout.params)}
        # frozen parameters keep their fp32 master in the stash until they train again
        shapes = {id(p): p.shape for p in self._order}
        result.update({pid: entry["master"].view(shapes[pid]).clone() for pid, entry in self._stash.items()})
        return result

    def param_shards(self) -> list[ParamShard]:
        if self.inner is None:
            return []
        names = {id(p): n for n, p in self.module.named_parameters()}
        group_of = {id(p): g for g, params in enumerate(self._groups) for p in params}
        shards = []
        for piece in self.layout.pieces:
            param = self.layout.params[piece.param]
            if self.alias:
                master, key = param.data.view(-1), param
            else:
                master = key = self.piece_views[id(param)]
            shards.append(
                ParamShard(names[id(param)], param.shape, piece.start, piece.end, master, key, group_of[id(param)])
            )
        return shards + self._extra_shards

    def _master_shard(self) -> torch.Tensor:
        """This rank's master slices as one contiguous shard (a copy when they live in the parameters)."""
        if self.master is not None:
            return self.master
        return torch.cat(self._master_slices) if self._master_slices else torch.zeros(0)

    def gather_flat(self, shard: torch.Tensor) -> torch.Tensor:
        """The full-size flat tensor whose slices, across ranks, are ``shard`` (collective)."""
        layout = self.layout
        if self.num_shards == 1:
            return shard
        full = shard.new_empty(layout.padded_numel)
        for bucket in layout.buckets:
            self.comm.all_gather(layout.bucket_slice(full, bucket), layout.shard_slice(shard, bucket))
        return full

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
