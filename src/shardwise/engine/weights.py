"""The engine's weights as files and dicts: checkpoints, 16-bit and Hugging Face exports, the full
``state_dict`` — a part of :class:`~.Engine`, which delegates each to the layer that does the work."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, cast

import torch
from torch import nn

from ..comm.distributed import Comm
from ..faults.announce import Announcer, collective
from ..model_io.export import save_state_dict
from ..model_io.pretrained import save_pretrained
from ..optim.precision import Precision
from ..zero.base import Strategy
from .state import EngineParts, EngineState

__all__ = ["WeightsSurface"]


class WeightsSurface:
    """Save, load and export what an engine trains."""

    module: nn.Module
    comm: Comm
    precision: Precision
    strategy: Strategy
    _label: str
    _announcer: Announcer
    _failed_step: Optional[str]

    @collective("save_checkpoint", after_agreement=True)
    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict[str, Any]] = None) -> str:
        """Collectively write a checkpoint (every rank its own shard); returns its path."""
        from ..checkpoint import save_checkpoint  # here: the checkpoint layer imports DCP (~1.4 s)

        return save_checkpoint(self.checkpointable(), save_dir, tag=tag, client_state=client_state)

    @collective("load_checkpoint", after_agreement=True)
    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None, *, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        module_load_fn: Any = None, strict: bool = True) -> tuple[Optional[str], Optional[dict[str, Any]]]:
        """Collectively restore a checkpoint (any world size or stage).

        Returns ``(load_path, client_state)`` as DeepSpeed does, or ``(None, None)`` with a warning when
        ``load_dir`` holds no checkpoint (so resume-if-present code needs no special case).
        """
        from ..checkpoint import load_checkpoint  # here: the checkpoint layer imports DCP (~1.4 s)

        loaded = load_checkpoint(self.checkpointable(), load_dir, tag=tag, load_optimizer_states=load_optimizer_states,
                                 load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                                 module_load_fn=module_load_fn, strict=strict)
        if loaded[0] is not None and not load_module_only:
            self._failed_step = None  # weights and optimizer state restored: a step that failed partway is undone
        return loaded

    @collective("save_16bit_model")
    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """Write the full weights in the compute dtype to ``save_dir/save_filename`` on rank 0 (collective).

        As DeepSpeed's: fp16/bf16 weights for a mixed-precision engine, fp32 otherwise; ``.safetensors`` names
        get a safetensors file, anything else ``torch.save``.  Tied weights are stored once.  True on every rank.
        """
        state = self.state_dict_16bit()
        if self.comm.rank == 0:
            save_state_dict(state, Path(save_dir) / save_filename)
        return True

    @collective("save_pretrained")
    def save_pretrained(self, save_dir: str) -> str:
        """Collective: ``config.json`` + ``model.safetensors`` from any stage, for ``from_pretrained``."""
        return save_pretrained(self, save_dir)

    def checkpointable(self) -> EngineState:
        """This engine as the checkpoint layer sees it (``shardwise.checkpoint.protocol.Checkpointable``)."""
        return EngineState(cast(EngineParts, self))  # only ever mixed into Engine, which has every part

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, master weights, gradients and optimizer state."""
        return self.strategy.memory_breakdown()

    @collective("full_state_dict")
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full-precision ``state_dict`` of the model on rank 0 (``{}`` elsewhere); collective.

        Tied parameters appear under each of their names but as one tensor.
        """
        masters = self.strategy.full_master_weights()
        if self.comm.rank != 0:
            return {}
        result: dict[str, torch.Tensor] = {}
        copies: dict[int, torch.Tensor] = {}
        for name, tensor in self.module.state_dict(keep_vars=True).items():
            if id(tensor) not in copies:
                value = masters.get(id(tensor))
                if value is None:
                    value = tensor.detach().clone()
                    value = value.float() if value.is_floating_point() else value
                copies[id(tensor)] = value.cpu()
            result[name] = copies[id(tensor)]
        return result

    @collective("state_dict_16bit")
    def state_dict_16bit(self) -> dict[str, torch.Tensor]:
        """:meth:`full_state_dict` with floating tensors in the compute dtype (rank 0; ``{}`` elsewhere; collective)."""
        state = self.full_state_dict()
        dtype = self.precision.dtype
        cast = {id(t): (t.to(dtype) if t.is_floating_point() else t) for t in state.values()}
        return {name: cast[id(t)] for name, t in state.items()}  # tied names stay one tensor

