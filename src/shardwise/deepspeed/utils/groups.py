"""DeepSpeed's `deepspeed.utils.groups`, as far as it means something here.

shardwise has no tensor, model, expert or sequence parallelism: those sizes are 1 and those ranks 0.
Data parallelism is the default process group (a pipeline's replicas are its engine's
`engine.groups.data`, which a script reaches through the engine).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..comm import get_rank as get_data_parallel_rank
from ..comm import get_world_size as get_data_parallel_world_size

__all__ = ["get_data_parallel_group", "get_data_parallel_rank", "get_data_parallel_world_size",
           "get_model_parallel_rank", "get_model_parallel_world_size", "get_sequence_parallel_world_size",
           "get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size"]


def get_data_parallel_group() -> Any:
    """The default process group (None without one)."""
    return dist.group.WORLD if dist.is_initialized() else None


def get_model_parallel_world_size() -> int:
    return 1


def get_model_parallel_rank() -> int:
    return 0


get_tensor_model_parallel_world_size = get_model_parallel_world_size
get_tensor_model_parallel_rank = get_model_parallel_rank


def get_sequence_parallel_world_size() -> int:
    return 1
