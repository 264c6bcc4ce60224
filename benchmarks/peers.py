"""The torch systems a user would pick instead of shardwise, set up to be fair peers.

* stage 0 ↔ ``DistributedDataParallel(gradient_as_bucket_view=True)``: gradients
  are views into the all-reduce buckets, like shardwise's flat gradient buffer
  (the default ``False`` would keep a second copy of every gradient).
* stage 1 ↔ the same DDP plus ``ZeroRedundancyOptimizer`` (AdamW inside,
  ``parameters_as_bucket_view=True`` so each rank broadcasts its updated
  parameters as one flat tensor).
* stage 2 ↔ FSDP2 ``fully_shard`` on every block and the root with
  ``reshard_after_forward=False``; stage 3 ↔ the same with ``True``.

bf16: FSDP2 uses ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``,
the same contract as shardwise (fp32 master weights, bf16 compute, fp32
gradient reduction).  DDP's own mixed precision (``mixed_precision=``) fails on
CPU ("cpu backend doesn't support events"), so DDP and ZeRO-1 run the usual
torch recipe instead: fp32 parameters with ``torch.autocast("cpu", bfloat16)``
around the forward, fp32 gradients reduced in fp32.  Autocast keeps LayerNorm,
softmax and the loss in fp32, so its losses differ from the pure-bf16 runs by
bf16 rounding, not by what is trained.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .configs import System, Workload
from .systems import local_bytes

__all__ = ["DDPHarness", "FSDP2Harness"]


def _unique_params(model: nn.Module) -> list[nn.Parameter]:
    return list({id(p): p for p in model.parameters()}.values())


def _grad_bytes(model: nn.Module) -> int:
    return local_bytes([p.grad for p in _unique_params(model) if p.grad is not None])


def _state_of(model: nn.Module, grads: int, optimizer_state: Any) -> dict[str, int]:
    return {
        "parameters": local_bytes(_unique_params(model)),
        "master_weights": 0,
        "gradients": grads,
        "optimizer_state": local_bytes(list(optimizer_state.values())),
    }


class DDPHarness:
    """DDP (``family="ddp"``), or DDP + ZeroRedundancyOptimizer (``family="zero1"``)."""

    def __init__(self, model: nn.Module, system: System, workload: Workload) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        self.model = model
        self.ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
        self.optimizer: Any
        if system.family == "zero1":
            self.optimizer = ZeroRedundancyOptimizer(
                model.parameters(),
                optimizer_class=torch.optim.AdamW,
                parameters_as_bucket_view=True,
                lr=workload.lr,
            )
        else:
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr)
        self.autocast = system.dtype == "bf16"
        self.state: dict[str, int] = {}

    def step(self, x: torch.Tensor, y: torch.Tensor, measure: bool) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            _, loss = self.ddp(x, y)
        loss.backward()
        grads = _grad_bytes(self.model) if measure else 0
        self.optimizer.step()
        if measure:
            # ZeroRedundancyOptimizer keeps this rank's state in its local `optim`.
            inner = getattr(self.optimizer, "optim", self.optimizer)
            self.state = _state_of(self.model, grads, inner.state)
        self.optimizer.zero_grad()
        return loss.detach()

    def bytes_sent(self) -> int | None:
        return None  # DDP's reducer calls gloo from C++: reported from theory instead

    def reset_counters(self) -> None:
        pass


class FSDP2Harness:
    """FSDP2 ``fully_shard`` per transformer block and on the root."""

    def __init__(self, model: nn.Module, system: System, workload: Workload) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy()
        if system.dtype == "bf16":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        reshard = system.stage == 3
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, reshard_after_forward=reshard, mp_policy=policy)
        fully_shard(model, reshard_after_forward=reshard, mp_policy=policy)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr)
        self.state: dict[str, int] = {}

    def step(self, x: torch.Tensor, y: torch.Tensor, measure: bool) -> torch.Tensor:
        _, loss = self.model(x, y)
        loss.backward()
        grads = _grad_bytes(self.model) if measure else 0
        self.optimizer.step()
        if measure:
            self.state = _state_of(self.model, grads, self.optimizer.state)
        self.optimizer.zero_grad()
        return loss.detach()

    def bytes_sent(self) -> int | None:
        return None  # reported from theory

    def reset_counters(self) -> None:
        pass
