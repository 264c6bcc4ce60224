"""`deepspeed.comm` for client scripts: DeepSpeed's names over `torch.distributed`.

Code written against `deepspeed.comm` runs unchanged with `import shardwise.deepspeed.comm as dist`. Ranks
and sizes answer 0 and 1 when no process group exists, as in a plain one-process run; collectives need a
group (`init_distributed`). DeepSpeed's profiling keywords (`prof`, `log_name`, `debug`) are accepted and
ignored. shardwise's own engine talks to `shardwise.comm.distributed.Comm`, not to this module.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from shardwise.comm.distributed import init_distributed as _init_from_env

__all__ = ["ReduceOp", "all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all_single", "barrier",
           "broadcast", "destroy_process_group", "get_global_rank", "get_local_rank", "get_rank", "get_world_group",
           "get_world_size", "inference_all_reduce", "init_distributed", "irecv", "is_available", "is_initialized",
           "isend", "new_group", "recv", "reduce", "reduce_scatter_tensor", "send"]

ReduceOp = dist.ReduceOp
_F = TypeVar("_F", bound=Callable[..., Any])
_PROFILING = ("prof", "log_name", "debug")


def _profiling_ignored(fn: _F) -> _F:
    """Accept DeepSpeed's comms-profiling keywords; shardwise counts bytes in `engine.comm` instead."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        for name in _PROFILING:
            kwargs.pop(name, None)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: timedelta = timedelta(minutes=30),
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Create the default process group, as DeepSpeed's `init_distributed` does, unless one exists: from `init_method`
    or `rank`/`world_size`, else from torchrun's environment (:func:`shardwise.init_distributed`).  MPI discovery and
    `distributed_port` have nothing to do under torchrun and are ignored."""
    if dist_init_required is False or dist.is_initialized():
        return
    if dist_backend not in (None, "nccl", "gloo"):
        raise ValueError(f"init_distributed(dist_backend={dist_backend!r}): shardwise runs on `nccl` (CUDA) or `gloo` "
                         "(CPU); pass one of them or None")
    if init_method is None and rank < 0 and world_size < 0:
        _init_from_env(backend=dist_backend, timeout=timeout.total_seconds())
        return
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=world_size,
                            timeout=timeout)


is_available = dist.is_available


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Any = None) -> int:
    """This process's rank in `group` (the world by default); 0 without a process group."""
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    """The number of ranks in `group` (the world by default); 1 without a process group."""
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    """This process's rank on its node (torchrun's `LOCAL_RANK`; 0 without a launcher)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group: Any, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_world_group() -> Any:
    return dist.group.WORLD


new_group = dist.new_group
destroy_process_group = dist.destroy_process_group


@_profiling_ignored
def barrier(group: Any = None, async_op: bool = False, device_ids: list[int] | None = None) -> Any:
    """Wait for every rank of `group`; nothing to wait for without a process group."""
    if not is_initialized():
        return None
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


# torch's own functions where DeepSpeed's names and order of arguments are torch's.
all_reduce = inference_all_reduce = _profiling_ignored(dist.all_reduce)
reduce = _profiling_ignored(dist.reduce)
broadcast = _profiling_ignored(dist.broadcast)
all_gather = _profiling_ignored(dist.all_gather)
all_gather_into_tensor = _profiling_ignored(dist.all_gather_into_tensor)
send = _profiling_ignored(dist.send)
recv = _profiling_ignored(dist.recv)
isend = _profiling_ignored(dist.isend)
irecv = _profiling_ignored(dist.irecv)


@_profiling_ignored
def reduce_scatter_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Any = None, async_op: bool = False) -> Any:
    return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


@_profiling_ignored
def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: Any = None, async_op: bool = False) -> Any:
    return dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
