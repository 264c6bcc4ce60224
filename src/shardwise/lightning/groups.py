"""The optimizer a Lightning user holds, mirrored into the one the engine steps (docs/lightning.md, "What a
LightningModule can use").

Lightning acts on the optimizer ``configure_optimizers`` returned (LR schedulers, ``LearningRateMonitor``,
``BaseFinetuning``'s ``add_param_group``), while the engine steps fp32 master shards.  So the engine gets a copy
(:attr:`GroupBridge.engine_optimizer`), and before every engine step :meth:`GroupBridge.push` copies each user group's
hyperparameters into it; a parameter in none of the user's groups has an inert group of its own until it joins one.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = ["GroupBridge"]


class GroupBridge:
    """``user``'s param groups mirrored, before every step, into :attr:`engine_optimizer`'s."""

    def __init__(self, user: torch.optim.Optimizer, module: nn.Module) -> None:
        self.user = user
        named = dict(module.named_parameters())
        ids = {id(p) for p in named.values()}
        held = {id(p) for group in user.param_groups for p in group["params"]}
        if held - ids:
            raise ValueError("the optimizer from `configure_optimizers` holds tensors that are not parameters of the "
                             "LightningModule; ShardwiseStrategy trains the module's own parameters: build the "
                             "optimizer from `self.parameters()` (or a subset)")
        missing = [(name, p) for name, p in named.items() if id(p) not in held]
        trainable = [name for name, p in missing if p.requires_grad]
        if trainable:
            raise ValueError(
                f"parameters {trainable[:5]}{' ...' if len(trainable) > 5 else ''} require grad but are in no param "
                "group of the optimizer from `configure_optimizers`: the engine would reduce their gradients and never "
                "apply them; freeze them (`requires_grad_(False)`, and `add_param_group` when they train) or put "
                "them in the optimizer")
        # The copy shares the parameters (memo) and nothing else: the user's object keeps its hooks and
        # the step wrapper its LR schedulers installed.
        self.engine_optimizer: torch.optim.Optimizer = copy.deepcopy(user, {id(p): p for p in named.values()})
        self._inert = {"lr": 0.0, **({"weight_decay": 0.0} if "weight_decay" in user.defaults else {})}
        first = len(user.param_groups)
        self._reserve = {id(p): first + i for i, (_, p) in enumerate(missing)}
        for _, param in missing:
            self.engine_optimizer.add_param_group({"params": [param], **self._inert})
        self._layout = [tuple(id(p) for p in group["params"]) for group in user.param_groups]

    def push(self, groups: list[dict[str, Any]]) -> None:
        """Copy the user's hyperparameters into the engine optimizer's ``groups`` (before a step)."""
        users = self.user.param_groups
        if len(users) < len(self._layout):
            raise RuntimeError(f"the optimizer's param groups went from {len(self._layout)} to {len(users)}; "
                               "ShardwiseStrategy can add groups (`add_param_group`) but not remove them")
        for index, ids in enumerate(self._layout):
            if tuple(id(p) for p in users[index]["params"]) != ids:
                raise RuntimeError(
                    f"param group {index} of the optimizer holds other parameters than at `setup`; ShardwiseStrategy "
                    "cannot move parameters between groups: add new ones with `optimizer.add_param_group`")
            _copy_hyperparameters(users[index], groups[index])
        added: dict[int, dict[str, Any]] = {}
        for group in users[len(self._layout):]:
            for param in group["params"]:
                if id(param) not in self._reserve:
                    raise RuntimeError("`add_param_group` was given a tensor that is not a parameter of the "
                                       "LightningModule; ShardwiseStrategy trains the module's own parameters")
                added[self._reserve[id(param)]] = group
        for index in self._reserve.values():
            if index in added:
                _copy_hyperparameters(added[index], groups[index])
            else:
                groups[index].update(self._inert)

    def pull(self, groups: list[dict[str, Any]]) -> None:
        """After a checkpoint restored the engine's groups: the user's groups take their hyperparameters."""
        for index in range(len(self._layout)):
            _copy_hyperparameters(groups[index], self.user.param_groups[index])

    def stepped(self) -> None:
        """The engine applied a step of the user's optimizer. torch's LR schedulers warn when they step before
        their optimizer did; they watch a flag the optimizer's (wrapped) ``step`` sets, and this is that step."""
        self.user._opt_called = True  # type: ignore[attr-defined]


def _copy_hyperparameters(source: dict[str, Any], target: dict[str, Any]) -> None:
    for key, value in source.items():
        if key != "params":
            target[key] = value
