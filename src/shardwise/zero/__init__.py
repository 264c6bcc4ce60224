"""ZeRO stages: one strategy class per stage over a shared interface."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..comm.distributed import Comm
from ..optim.precision import Precision
from .base import Strategy
from .flat.strategy import Stage0, Stage1, Stage2
from .stage3.hooks import GatheredParameters, register_external_parameter
from .stage3.init import Init
from .stage3.strategy import Stage3
from .stage3.weights import LoadResult, load_state_dict

__all__ = [
    "GatheredParameters", "Init", "LoadResult", "Strategy", "load_state_dict", "make_strategy",
    "register_external_parameter",
]


def make_strategy(module: nn.Module, comm: Comm, precision: Precision, zero_config: Any) -> Strategy:
    """The strategy for ``zero_config.stage``."""
    stages: dict[int, type[Strategy]] = {0: Stage0, 1: Stage1, 2: Stage2, 3: Stage3}
    # the config validator already restricts the stage to 0..3
    return stages[zero_config.stage](module, comm, precision, zero_config)
