"""`deepspeed.zero` for client scripts: `Init`, `GatheredParameters`, `register_external_parameter`.

`GatheredParameters` and `register_external_parameter` are shardwise's own, which already take
DeepSpeed's arguments. `Init` takes DeepSpeed's signature (`module` first, `config_dict_or_path`,
`data_parallel_group`, ...) and builds :class:`shardwise.zero.Init`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise import zero as _zero
from shardwise.zero import GatheredParameters, register_external_parameter

__all__ = ["GatheredParameters", "Init", "register_external_parameter"]


def Init(  # noqa: N802 - DeepSpeed's name; a function returning the context manager
    module: nn.Module | None = None,
    data_parallel_group: Any = None,
    mem_efficient_linear: bool = True,
    remote_device: str | None = None,
    pin_memory: bool = False,
    config_dict_or_path: Any = None,
    config: Any = None,
    enabled: bool = True,
    dtype: torch.dtype | None = None,
    mpu: Any = None,
    zero_param_parallel_group: Any = None,
    zero_quantized_weights: bool = False,
    zero_quantized_nontrainable_weights: bool = False,
    sequence_data_parallel_group: Any = None,
    param_swapper: Any = None,
) -> _zero.Init:
    """Build modules already partitioned for ZeRO stage 3, with DeepSpeed's arguments (each: docs/from-deepspeed.md,
    "What `shardwise.deepspeed` provides").  `pin_memory`, `mem_efficient_linear` and `dtype` change nothing (the engine
    casts to the config's dtype); arguments that turn on a feature shardwise lacks are errors."""
    given = dict(mpu=mpu, zero_param_parallel_group=zero_param_parallel_group,
                 zero_quantized_weights=zero_quantized_weights,
                 zero_quantized_nontrainable_weights=zero_quantized_nontrainable_weights,
                 sequence_data_parallel_group=sequence_data_parallel_group, param_swapper=param_swapper)
    lacking = [f"`{name}={value!r}`" for name, value in given.items() if value not in (None, False)]
    if lacking:
        raise ValueError(f"shardwise.deepspeed.zero.Init: {', '.join(lacking)} turn(s) on DeepSpeed features shardwise "
                         "does not implement (ZeRO++ quantization, model/sequence parallelism, a parameter swapper); "
                         "remove them")
    if config is not None and config_dict_or_path is not None:
        raise ValueError("shardwise.deepspeed.zero.Init got both `config` and `config_dict_or_path`; pass one")
    if not enabled:
        # DeepSpeed scripts write `Init(config_dict_or_path=cfg, enabled=stage == 3)` for every stage.
        return _zero.Init(enabled=False)
    chosen = config if config is not None else config_dict_or_path
    return _zero.Init(config=chosen, process_group=data_parallel_group, module=module, remote_device=remote_device)
