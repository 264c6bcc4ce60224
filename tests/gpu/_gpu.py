"""What the GPU tier's tests share: the devices, a one-rank group, the model and data, the plain-torch reference.

The model is examples/gpt.py's GPT (attention, LayerNorm, a head tied to the
embedding): what users train.  The reference is plain torch doing by hand
what mixed precision means: fp32 master weights and AdamW, a compute-dtype
copy for forward and backward, the loss scaled by a static power of two in
fp16.  At world size 1 a shardwise engine must train to the same masters.

``ZERO_VARIANTS`` is the hook for storage variants: each entry's
``zero_optimization`` keys are added to every stage it names, and the parity
and checkpoint tests run it.  The offload variants (issue 38): the optimizer's
state in host memory (``cpu``) or in files (``nvme``, under :data:`NVME`),
all of it or half of its sub-groups (``ratio`` 0.5: on the device for ``cpu``,
in host memory for ``nvme``), and stage 3's parameters in host memory
(``offload_param: cpu``) or in a file (``nvme``, with half the optimizer's state).  ``sub_group_size`` is small enough that the tiny
GPT's state spans several sub-groups.  On the CPU the same variants take the
host path under :func:`~shardwise.zero.store.plan.host_path_on_cpu` (host
buffers apart from the model's, plain copies), so the CPU cases of this tier
exercise it too.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

import pytest
import torch
from torch import nn

import shardwise
from shardwise.zero.store.plan import host_path_on_cpu

ROOT = Path(__file__).resolve().parents[2]

CPU = pytest.param("cpu", id="cpu")
CUDA = pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)
#: every test body takes one of these
DEVICES = [CPU, CUDA]
#: for a test whose CPU case is slow and adds nothing the regular suite lacks (the body still takes a device)
CUDA_ONLY = [CUDA]

DTYPES: dict[str, Optional[torch.dtype]] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
#: a power of two: scaling by it is exact, so the reference scales the same way without tracking dynamics
LOSS_SCALE = 128.0
LR = 1e-3
MICRO = 2
SEQ = 16

#: where the NVMe variants' files go (each rank of each engine makes its own folder under it)
NVME = str(Path(tempfile.gettempdir()) / "shardwise-gpu-nvme")
#: elements stepped at a time where the optimizer is offloaded (the tiny GPT's ~0.12M span several sub-groups)
SUB_GROUP = 20_000
_CPU_OPT = {"device": "cpu", "pin_memory": True}
_NVME_OPT = {"device": "nvme", "nvme_path": NVME, "pin_memory": True, "buffer_count": 3}

#: name -> (stages it applies to, extra `zero_optimization` keys); see the module docstring
ZERO_VARIANTS: dict[str, tuple[tuple[int, ...], dict[str, Any]]] = {
    "in-memory": ((0, 1, 2, 3), {}),
    "offload-cpu": ((1, 2, 3), {"offload_optimizer": _CPU_OPT, "sub_group_size": SUB_GROUP}),
    "offload-cpu-half": ((1, 2, 3), {"offload_optimizer": {**_CPU_OPT, "ratio": 0.5}, "sub_group_size": SUB_GROUP}),
    "offload-nvme": ((1, 2, 3), {"offload_optimizer": _NVME_OPT, "sub_group_size": SUB_GROUP}),
    "offload-nvme-half": ((1, 2, 3), {"offload_optimizer": {**_NVME_OPT, "ratio": 0.5}, "sub_group_size": SUB_GROUP}),
    "offload-param-cpu": ((3,), {"offload_optimizer": _CPU_OPT, "offload_param": {"device": "cpu", "pin_memory": True},
                                 "sub_group_size": SUB_GROUP}),
    # every shard read from its file at each use (`max_in_cpu` 0), read ahead two units past a prefetch of one unit
    "offload-param-nvme": ((3,), {"offload_optimizer": {**_NVME_OPT, "ratio": 0.5}, "sub_group_size": SUB_GROUP,
                                  "stage3_prefetch_bucket_size": 1,
                                  "offload_param": {**_NVME_OPT, "buffer_count": 2, "max_in_cpu": 0}}),
}


def offloads(variant: str) -> bool:
    """Whether ``variant`` offloads anything."""
    return variant != "in-memory"


def zero_cases() -> list[Any]:
    """(stage, variant) for every variant at every stage it applies to, as pytest params."""
    return [pytest.param(stage, name, id=f"s{stage}-{name}", marks=[pytest.mark.offload] if offloads(name) else [])
            for name, (stages, _) in ZERO_VARIANTS.items() for stage in stages]


def one_rank(device: str) -> torch.device:
    """A one-rank default group for ``device`` (NCCL on ``cuda``, gloo on ``cpu``); fp32 matmuls stay fp32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    shardwise.init_distributed(backend="nccl" if device == "cuda" else "gloo")
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


def gpt_module() -> ModuleType:
    """examples/gpt.py."""
    examples = str(ROOT / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import gpt

    return gpt


def gpt(seed: int = 0, **overrides: Any) -> nn.Module:
    """The tiny GPT preset (64 wide, 2 layers, ~0.12M parameters), seeded, on the CPU."""
    module = gpt_module()
    torch.manual_seed(seed)
    return module.GPT(module.gpt_config("tiny", **overrides))  # type: ignore[no-any-return]


def batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s token windows ``(x, y)`` on ``device``: the same on every device and every run."""
    gen = torch.Generator().manual_seed(7919 * step + 1)
    tokens = torch.randint(0, 256, (MICRO, SEQ + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def config(stage: int, dtype: str, variant: str = "in-memory") -> dict[str, Any]:
    """The engine config: ``stage`` (every parameter sharded at stage 3), ``dtype``, the variant's keys."""
    zero: dict[str, Any] = {"stage": stage, **ZERO_VARIANTS[variant][1]}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # the hard path: every module's weights gathered
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": zero}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": LOSS_SCALE}
    return cfg


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def engine(stage: int, dtype: str, variant: str = "in-memory", seed: int = 0) -> Any:
    """An engine for the tiny GPT; an offload variant takes the host path on the CPU too (module docstring)."""
    model = gpt(seed)
    if "nvme" in variant:
        Path(NVME).mkdir(parents=True, exist_ok=True)
    with host_path_on_cpu() if offloads(variant) else contextlib.nullcontext():
        return shardwise.initialize(model, adamw(model.parameters()), config(stage, dtype, variant))


def train(engine: Any, first: int, steps: int, device: torch.device) -> list[float]:
    """Steps ``first`` to ``first + steps`` of ``engine``; the losses."""
    losses = []
    for step in range(first, first + steps):
        _, loss = engine(*batch(step, device))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def masters(engine: Any) -> dict[str, torch.Tensor]:
    """The engine's full fp32 weights (its masters), on the CPU; collective."""
    return {k: v.detach().float().cpu() for k, v in engine.full_state_dict().items()}


def plain_torch(device: torch.device, dtype: str, steps: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The reference: ``steps`` of plain-torch mixed precision (see the module docstring); masters and losses."""
    master = gpt(seed).to(device)
    optimizer = adamw(master.parameters())
    low_dtype = DTYPES[dtype]
    model = master if low_dtype is None else copy.deepcopy(master).to(low_dtype)
    scale = LOSS_SCALE if dtype == "fp16" else 1.0
    losses = []
    for step in range(steps):
        _, loss = model(*batch(step, device))
        (loss * scale).backward()
        if model is not master:
            for m, p in zip(master.parameters(), model.parameters()):
                m.grad = p.grad.float() / scale
                p.grad = None
        optimizer.step()
        optimizer.zero_grad()
        if model is not master:
            with torch.no_grad():
                for m, p in zip(master.parameters(), model.parameters()):
                    p.copy_(m)
        losses.append(float(loss.detach()))
    return {k: v.detach().float().cpu() for k, v in master.state_dict().items()}, losses


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest absolute difference over every tensor, and where."""
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return max(((got[k] - want[k]).abs().max().item(), k) for k in want)
