"""`deepspeed.runtime.utils` helpers that client scripts import.

`set_random_seed` (DeepSpeedExamples' pipeline script), `see_memory_usage` (Megatron-DeepSpeed),
`move_to_device`, and the partition helpers `partition_uniform` / `partition_balanced` (the ones
`PipelineModule` uses for `partition_method`).
"""

from __future__ import annotations

import gc
import random
from collections.abc import Callable
from typing import Any

import numpy
import torch
import torch.distributed as dist

from shardwise.pipe.partition import least_spread, uniform

from ..accelerator import get_accelerator
from ..utils.logging import logger

__all__ = ["move_to_device", "partition_balanced", "partition_uniform", "see_memory_usage", "set_random_seed"]


def set_random_seed(seed: int) -> None:
    """Seed Python's `random`, numpy's global RNG and torch, as DeepSpeed's does."""
    random.seed(seed)
    numpy.random.seed(seed % 2**32)  # numpy takes 32-bit seeds only
    torch.manual_seed(seed)


def see_memory_usage(message: str, force: bool = False) -> None:
    """With `force`, log `message` and the accelerator's memory in use on rank 0 (else nothing)."""
    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    gc.collect()
    accelerator: Any = get_accelerator()  # CPU and CUDA both count memory; the base class does not declare it
    gib = 1024**3
    logger.info("%s | memory allocated %.2f GB, max allocated %.2f GB", message,
                accelerator.memory_allocated() / gib, accelerator.max_memory_allocated() / gib)


def move_to_device(item: Any, device: torch.device | str, criterion_func: Callable[[Any], bool] | None = None) -> Any:
    """`item` (a tensor, or lists/tuples/dicts of them) with its tensors on `device`; tensors that fail
    `criterion_func` stay where they are."""
    if isinstance(item, torch.Tensor):
        return item.to(device) if criterion_func is None or criterion_func(item) else item
    if isinstance(item, (list, tuple)):
        return type(item)(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries of `num_parts` parts of `num_items` items, the first ones one item longer."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    return uniform(num_items, num_parts)


def partition_balanced(weights: list[int], num_parts: int) -> list[int]:
    """DeepSpeed's balanced boundaries (what `partition_method="parameters"` uses)."""
    if len(weights) <= num_parts:
        return partition_uniform(len(weights), num_parts)
    return least_spread(weights, num_parts)
