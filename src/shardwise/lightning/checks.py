"""What ``ShardwiseStrategy`` refuses at ``setup``: Lightning features it would otherwise carry out differently.

Each refusal names the feature and what to do instead; none is a silent difference.
"""

from __future__ import annotations

from typing import Any

import torch

from .config import PRECISIONS
from .flavour import Flavour

__all__ = ["refuse_unsupported", "single_optimizer"]


def refuse_unsupported(flavour: Flavour, trainer: Any, module: Any, precision: str, chosen_by: str,
                       fitting: bool) -> None:
    """Raise for the first Lightning feature of this run the strategy does not carry out as Lightning would
    (outside ``fit``, only the precision matters)."""
    overridden = flavour.is_overridden
    if precision not in PRECISIONS:
        by = f" (the plugin `{chosen_by}`)" if chosen_by else ""
        raise ValueError(f"ShardwiseStrategy does not support `precision={precision!r}`{by}; use one of "
                         f"{sorted(PRECISIONS)}")
    if not fitting:
        return
    if overridden("backward", module, flavour.LightningModule):
        raise ValueError("`LightningModule.backward` is overridden, but ShardwiseStrategy runs the backward in the "
                         "engine (loss scaling, gradient reduction); remove the override and put extra work in "
                         "`on_before_backward` / `on_after_backward`")
    if overridden("configure_gradient_clipping", module, flavour.LightningModule):
        raise ValueError("`configure_gradient_clipping` is overridden, but the engine clips the reduced gradients "
                         "itself, by global norm; remove the override and set `Trainer(gradient_clip_val=...)`")
    algorithm = getattr(trainer, "gradient_clip_algorithm", None)
    if getattr(algorithm, "value", algorithm) == "value":
        raise ValueError("`Trainer(gradient_clip_algorithm='value')`: the engine clips by global norm only (as "
                         "DeepSpeedStrategy); use `gradient_clip_algorithm='norm'`")


def single_optimizer(optimizers: list[Any], schedulers: list[Any]) -> Any:
    """The one optimizer ``configure_optimizers`` returned (its schedulers must act on it), or None when it returned
    none (the config's ``optimizer`` section may give one, as for DeepSpeedStrategy)."""
    if len(optimizers) == 1 and type(optimizers[0]).__name__ == "_MockOptimizer":
        return None
    if len(optimizers) != 1:
        raise ValueError(f"`configure_optimizers` returned {len(optimizers)} optimizers; ShardwiseStrategy trains "
                         "with one (use param groups for different settings, or DDPStrategy for several optimizers)")
    optimizer = optimizers[0]
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("LBFGS evaluates its closure several times per step, which ShardwiseStrategy (as "
                         "DeepSpeedStrategy) does not support; use another optimizer")
    for config in schedulers:
        if getattr(config.scheduler, "optimizer", optimizer) is not optimizer:
            raise ValueError("an LR scheduler from `configure_optimizers` acts on another optimizer than the one "
                             "returned; build it on that optimizer")
    return optimizer
