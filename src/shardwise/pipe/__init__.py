"""Pipeline parallelism: one model definition, trained pipelined or as a plain module.

``shardwise.initialize`` turns a ``PipelineModule`` of more than one stage into a :class:`PipelineEngine` (1F1B over the
stages, ZeRO-0/1 across replicas); ``to_sequential()`` trains the same layers at any ZeRO stage. See docs/pipeline.md.
"""

from __future__ import annotations

from .engine import PipelineEngine
from .layers import LayerSpec, PipelineSequential, TiedLayerSpec
from .module import PipelineModule

__all__ = ["LayerSpec", "PipelineEngine", "PipelineModule", "PipelineSequential", "TiedLayerSpec"]

