"""Pipeline parallelism: one model definition, trained pipelined or as a plain module.

``PipelineModule(layers, num_stages=...)`` cuts a list of layers into stages; ``shardwise.initialize`` turns it into a
:class:`PipelineEngine` (1F1B over the stages, ZeRO-0/1 across data-parallel replicas) when it has more than one stage,
and into an ordinary engine otherwise.  ``to_sequential()`` exports the same layers as a plain module (tied weights and
activation checkpointing kept) that trains at any ZeRO stage.  See ``docs/pipeline.md``.
"""

from __future__ import annotations

from .engine import PipelineEngine
from .layers import LayerSpec, PipelineSequential, TiedLayerSpec
from .module import PipelineModule

__all__ = ["LayerSpec", "PipelineEngine", "PipelineModule", "PipelineSequential", "TiedLayerSpec"]

