"""A drop-in for DeepSpeed client scripts: change only the imports (``import shardwise.deepspeed as deepspeed``).

`engine` is a :class:`shardwise.Engine` with DeepSpeed's methods; `comm`, `zero`, `accelerator`, `pipe`, `utils` and
`runtime.utils` are here under DeepSpeed's names. This dialect keeps DeepSpeed's defaults where `shardwise.initialize`
keeps plain PyTorch's (:mod:`.defaults`). docs/from-deepspeed.md shows a ported script and lists what differs.
"""

from __future__ import annotations

from shardwise.engine.engine import Engine as DeepSpeedEngine

from . import accelerator, comm, pipe, runtime, utils, zero
from .comm import init_distributed
from .initialize import add_config_arguments, initialize
from .pipe import PipelineModule

__all__ = ["DeepSpeedEngine", "PipelineModule", "accelerator", "add_config_arguments", "comm", "init_distributed",
           "initialize", "pipe", "runtime", "utils", "zero"]
