"""The one optimizer registry: which torch optimizer each config `optimizer.type` names.

This module only describes; `shardwise.optim.optimizers.build_optimizer` builds from it and the
`optimizer` config section validates against it. Every optimizer here updates each element
from its own gradient and state, which is what lets ZeRO shard it piece by piece (see
docs/zero.md); whole-tensor optimizers (LAMB, Adafactor, Muon) do not fit.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["DEEPSPEED_ONLY_OPTIMIZERS", "OPTIMIZERS", "OptimizerSpec"]


@dataclass(frozen=True)
class OptimizerSpec:
    """One `optimizer.type`: the torch class it builds and DeepSpeed's extra arguments it accepts."""

    torch_class: type[torch.optim.Optimizer]
    # DeepSpeed arguments that are not torch's: name -> what it means here.
    extras: Mapping[str, str] = field(default_factory=dict)

    def torch_arguments(self) -> dict[str, Any]:
        """torch's keyword arguments (name -> default) for this optimizer, `params` excluded."""
        signature = inspect.signature(self.torch_class).parameters
        return {n: p.default for n, p in signature.items() if n != "params"}

    def known_arguments(self) -> list[str]:
        return [*self.torch_arguments(), *self.extras]

    def build_with(self, params: Mapping[str, Any]) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
        """The torch class and keyword arguments a validated `params` mapping stands for."""
        kwargs = {k: v for k, v in params.items() if k not in self.extras}
        cls = self.torch_class
        # DeepSpeed's `type: Adam` is decoupled weight decay (AdamW) unless `adam_w_mode: false`.
        if cls is torch.optim.Adam and params.get("adam_w_mode", True):
            cls = torch.optim.AdamW
        if "betas" in kwargs:
            kwargs["betas"] = tuple(kwargs["betas"])
        return cls, kwargs

    def default(self, name: str) -> Any:
        """torch's default for argument `name` (e.g. `lr`)."""
        return self.torch_arguments()[name]


_ADAM_EXTRAS = {
    "adam_w_mode": "true (DeepSpeed's default): `Adam` means decoupled weight decay, i.e. torch's AdamW",
    "torch_adam": "accepted; shardwise always uses torch's implementation",
    "bias_correction": "true (DeepSpeed's default): torch's Adam always corrects the moments' bias; false is refused",
}

#: DeepSpeed's names (any case in a config) -> spec. DeepSpeed accepts any `torch.optim` name;
#: these are the element-wise ones.
OPTIMIZERS: dict[str, OptimizerSpec] = {
    "Adam": OptimizerSpec(torch.optim.Adam, _ADAM_EXTRAS),
    "AdamW": OptimizerSpec(torch.optim.AdamW, _ADAM_EXTRAS),
    "SGD": OptimizerSpec(torch.optim.SGD),
    "Adagrad": OptimizerSpec(torch.optim.Adagrad),
    "RMSprop": OptimizerSpec(torch.optim.RMSprop),
    "Adamax": OptimizerSpec(torch.optim.Adamax),
    "NAdam": OptimizerSpec(torch.optim.NAdam),
    "RAdam": OptimizerSpec(torch.optim.RAdam),
    "Adadelta": OptimizerSpec(torch.optim.Adadelta),
}

#: DeepSpeed's own optimizers (its `optimizer.type` names) that shardwise does not provide.
DEEPSPEED_ONLY_OPTIMIZERS = {
    "Lamb": "LAMB (a whole-tensor trust ratio, which piecewise ZeRO sharding cannot compute)",
    "OneBitAdam": "1-bit Adam (compressed communication)",
    "ZeroOneAdam": "0/1 Adam (compressed communication)",
    "OneBitLamb": "1-bit LAMB (compressed communication)",
    "Lion": "Lion (DeepSpeed's fused kernel)",
    "MuAdam": "MuAdam (muP scaling)",
    "MuAdamW": "MuAdamW (muP scaling)",
    "MuSGD": "MuSGD (muP scaling)",
    "Muon": "Muon (whole-matrix orthogonalisation, which piecewise ZeRO sharding cannot compute)",
}
