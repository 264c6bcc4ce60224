"""DeepSpeed at the same ZeRO stage, when it is importable (``--deepspeed``).

DeepSpeed is not a dependency of shardwise: install it in a throwaway virtual
environment (``pip install wheel; pip install --no-build-isolation deepspeed``)
and run the benchmark with that interpreter.  On a machine without CUDA it runs
with ``DS_ACCELERATOR=cpu`` over the gloo group the launcher created.

Tensor accounting is approximate: module parameters (their ZeRO-3 partition,
``ds_tensor``, at stage 3), and the inner torch optimizer's parameters (fp32
partitions: master weights), their gradients and its state.  DeepSpeed's
internal reduction buckets are not counted.
"""

from __future__ import annotations

import importlib.metadata
import os
from typing import Any

import torch
from torch import nn

from .configs import System, Workload
from .systems import local_bytes

__all__ = ["DeepSpeedHarness", "deepspeed_installed"]


def deepspeed_installed() -> bool:
    """Whether DeepSpeed is installed, not merely importable: ``examples/deepspeed`` (on ``sys.path`` wherever an
    example model is imported, and so in the processes spawned from there) imports as an empty namespace package."""
    try:
        importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def ready_for_deepspeed() -> None:
    """What DeepSpeed's engine reads from the environment in a process no launcher started: its accelerator (the
    CPU where torch sees no GPU) and LOCAL_RANK, its device."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_RANK", str(torch.cuda.current_device() if torch.cuda.is_available() else 0))


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer at the bottom of DeepSpeed's wrappers."""
    for _ in range(5):
        if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


class DeepSpeedHarness:
    """``deepspeed.initialize`` with torch AdamW as the client optimizer."""

    def __init__(self, model: nn.Module, system: System, workload: Workload) -> None:
        ready_for_deepspeed()
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": workload.micro_batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,  # DeepSpeed's default would clip at 1.0; the others do not clip
            "zero_optimization": {"stage": system.stage},
            "bf16": {"enabled": system.dtype == "bf16"},
            "steps_per_print": 1 << 30,
        }
        optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
        self.model = model
        self.state: dict[str, int] = {}

    def step(self, x: torch.Tensor, y: torch.Tensor, measure: bool) -> torch.Tensor:
        _, loss = self.engine(x, y)
        self.engine.backward(loss)
        grads = 0
        if measure:  # DeepSpeed's step drops the gradients: count them here
            grads = local_bytes([p.grad for p in self._params() + self._masters() if p.grad is not None])
        self.engine.step()
        if measure:
            self.state = self._accounting(grads)
        return loss.detach()

    def _params(self) -> list[torch.Tensor]:
        return list({id(p): p for p in self.model.parameters()}.values())

    def _masters(self) -> list[torch.Tensor]:
        """The inner optimizer's tensors that are not module parameters: fp32 partitions."""
        inner = _inner_optimizer(self.engine.optimizer)
        module_ptrs = {getattr(p, "ds_tensor", p.data).data_ptr() for p in self._params()}
        tensors = [] if inner is None else [p for g in inner.param_groups for p in g["params"]]
        return [p for p in tensors if p.data_ptr() not in module_ptrs]

    def _accounting(self, grads: int) -> dict[str, int]:
        inner = _inner_optimizer(self.engine.optimizer)
        return {
            "parameters": local_bytes([getattr(p, "ds_tensor", p.data) for p in self._params()]),
            "master_weights": local_bytes(self._masters()),
            "gradients": grads,
            "optimizer_state": 0 if inner is None else local_bytes(list(inner.state.values())),
        }

    def bytes_sent(self) -> int | None:
        return None  # reported from theory

    def reset_counters(self) -> None:
        pass
