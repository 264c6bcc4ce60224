"""Checks of what users hand the engine, before anything is built or communicated.

Each raises an error naming the value, what was expected and the fix; they run on one rank without
collectives, so a rank that fails one raises at once and the others read its published error.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["check_loss", "check_model", "check_trainable"]


def check_model(module: Any, rank: int) -> None:
    """The model is an ``nn.Module`` whose parameters the engine can lay out."""
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"rank {rank}: `shardwise.initialize` needs a `torch.nn.Module`, got `{type(module).__name__}`; "
            "wrap your function in a module (`class Net(nn.Module): def forward(self, x): ...`)"
        )
    for name, param in module.named_parameters():
        if param.is_sparse or param.layout != torch.strided:
            raise ValueError(
                f"rank {rank}: parameter `{name}` has layout `{param.layout}`; shardwise shards dense "
                "parameters only: make it a dense tensor (`nn.Parameter(value.to_dense())`)"
            )


def check_trainable(module: nn.Module, params: list[Any], wants_optimizer: bool, rank: int) -> None:
    """An optimizer needs parameters to optimize (a model with none, or only buffers, is inference-only)."""
    if not wants_optimizer or params:
        return
    if next(module.parameters(), None) is not None:
        raise ValueError(
            f"rank {rank}: `model_parameters` is empty, so the optimizer has nothing to update; pass the "
            "parameters to train (or leave `model_parameters` out to train all of them)"
        )
    what = "only buffers" if next(module.buffers(), None) is not None else "no parameters and no buffers"
    raise ValueError(
        f"rank {rank}: the model `{type(module).__name__}` has {what}, so an optimizer has nothing to update; "
        "build an inference-only engine (no `optimizer` argument and no `optimizer` section), or give the "
        "model parameters"
    )


def check_loss(loss: Any, rank: int, engine: str) -> None:
    """``engine.backward(loss)`` gets a scalar tensor that autograd can differentiate."""
    if not isinstance(loss, torch.Tensor):
        fix = ("the model returned several values: pass the loss among them (`logits, loss = engine(x, y)`)"
               if isinstance(loss, (tuple, list, dict)) else
               "pass the tensor your model (or loss function) returned, not `loss.item()`")
        raise TypeError(
            f"rank {rank}: `backward` of {engine} needs the loss as a tensor, got `{type(loss).__name__}`; {fix}"
        )
    if loss.numel() != 1:
        raise ValueError(
            f"rank {rank}: `backward` of {engine} needs a scalar loss, got shape {tuple(loss.shape)}; reduce it "
            "first (`loss.mean()` or `loss.sum()`), as `torch.nn` losses do with their default `reduction`"
        )
    if not loss.is_floating_point():
        raise ValueError(
            f"rank {rank}: `backward` of {engine} got a `{loss.dtype}` loss; losses must be floating point"
        )
    if not loss.requires_grad:
        raise ValueError(
            f"rank {rank}: the loss passed to `backward` of {engine} does not require grad: it was computed "
            "under `torch.no_grad()`, detached, or from no trainable parameter (all frozen?); compute it from "
            "the engine's output with grad enabled, or unfreeze a parameter (`requires_grad_(True)`)"
        )
