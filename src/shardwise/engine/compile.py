"""``engine.compile()``: DeepSpeed's way to ``torch.compile`` the wrapped module in place.

Every stage also takes a model compiled before ``shardwise.initialize`` (``torch.compile(model)``, or
``block.compile()`` per block as FSDP2 recommends).  At stage 3 the gathering hooks run between graphs, never
inside one (``zero/stage3/params.py``; docs/stage3.md gives the graph counts).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

__all__ = ["compile_module", "is_compiled_module"]

logger = logging.getLogger("shardwise")


def is_compiled_module(module: nn.Module) -> bool:
    """Whether ``module`` runs compiled: ``module.compile()`` was called, or it is ``torch.compile(model)``."""
    if getattr(module, "_compiled_call_impl", None) is not None:
        return True
    return type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod")


def compile_module(module: nn.Module, backend: Any, compile_kwargs: Optional[dict[str, Any]], schedule: Any,
                   compiled_autograd_enabled: bool, rank: int) -> None:
    """``module.compile(backend=backend, **compile_kwargs)``, in place, after checking what shardwise lacks."""
    if schedule is not None:
        raise ValueError(
            f"rank {rank}: `engine.compile(schedule={schedule!r})` asks for a DeepCompile schedule; shardwise "
            "has no DeepCompile: call `engine.compile(backend=..., compile_kwargs=...)` without `schedule`"
        )
    if compiled_autograd_enabled:
        raise ValueError(
            f"rank {rank}: `engine.compile(compiled_autograd_enabled=True)` would trace the backward, and "
            "shardwise's gradient hooks are not traceable; leave it False (the backward of each compiled "
            "forward graph is still compiled by AOTAutograd)"
        )
    kwargs = dict(compile_kwargs or {})
    if "backend" in kwargs:
        logger.warning("engine.compile: `compile_kwargs['backend']` is overridden by the `backend` argument "
                       "(%r); pass the backend there", backend)
    kwargs["backend"] = backend
    if not hasattr(torch, "compile"):
        raise RuntimeError(f"rank {rank}: `engine.compile()` needs torch.compile (PyTorch 2.0 or later)")
    module.compile(**kwargs)
