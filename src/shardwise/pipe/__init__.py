"""Pipeline parallelism: one model definition, trained pipelined or as a plain module.

``PipelineModule(layers, num_stages=...)`` cuts a list of layers into stages;
``shardwise.initialize`` turns it into a :class:`PipelineEngine` (1F1B over
the stages, ZeRO-0/1 across data-parallel replicas) when it has more than one
stage, and into an ordinary engine otherwise.  ``to_sequential()`` exports the
same layers as a plain module (tied weights and activation checkpointing
kept) that trains at any ZeRO stage.  See ``docs/pipeline.md``.
"""

from __future__ import annotations

from .module import PipelineModule
from .sequential import PipelineSequential
from .spec import LayerSpec, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineEngine", "PipelineModule", "PipelineSequential", "TiedLayerSpec"]


def __getattr__(name: str) -> object:
    # The engine imports the whole training stack; a model definition should not need it.
    if name == "PipelineEngine":
        from .engine import PipelineEngine

        return PipelineEngine
    raise AttributeError(f"module `shardwise.pipe` has no attribute `{name}`")
