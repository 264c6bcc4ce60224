"""Where a launch's ranks run: on the GPUs when there is one for each local rank, otherwise on the CPU.

``shardwise run`` asks :func:`plan_placement` before it starts any process: with fewer visible GPUs than local ranks
(two ranks on a one-GPU machine, README command 1 there) the ranks get an empty ``CUDA_VISIBLE_DEVICES``, so they
use gloo on the CPU, and the launch says so in one line (NCCL cannot put two ranks on one GPU: rank 1 dies in
``torch.cuda.set_device(1)``).  Under ``torchrun`` directly, ``init_distributed`` calls :func:`require_gpu` for an
error naming ``LOCAL_RANK``, the GPUs seen and the fixes, instead of CUDA's "invalid device ordinal".
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional

import torch

__all__ = ["DeviceError", "Placement", "plan_placement", "require_gpu", "visible_gpus"]


class DeviceError(RuntimeError):
    """A rank was asked to run on a GPU it cannot see."""


def visible_gpus() -> int:
    """The CUDA devices this process can use (0 without CUDA; ``CUDA_VISIBLE_DEVICES`` counts)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True)
class Placement:
    """What a launch of ``nproc`` local ranks does: the device its ranks use, their extra environment, a note."""

    device: str
    #: variables set for every rank (on top of the launcher's environment)
    env: Mapping[str, str] = field(default_factory=dict)
    #: the one line the launcher prints, or None when there is nothing to say
    note: Optional[str] = None


def _visible_now(environ: Mapping[str, str]) -> str:
    value = environ.get("CUDA_VISIBLE_DEVICES")
    return f" (now `CUDA_VISIBLE_DEVICES={value}`)" if value is not None else ""


def plan_placement(nproc: int, gpus: int, environ: Mapping[str, str] = os.environ) -> Placement:
    """Where ``nproc`` local ranks run when ``gpus`` GPUs are visible (see the module docstring)."""
    if gpus == 0:
        return Placement("cpu")
    if nproc <= gpus:
        return Placement("cuda")
    plural = "s are" if gpus > 1 else " is"
    note = (
        f"shardwise run: {nproc} ranks asked for (--nproc-per-node {nproc}) but {gpus} GPU{plural} visible, so "
        f"the {nproc} ranks run on the CPU with gloo; to train on the GPU{'s' if gpus > 1 else ''} pass "
        f"`--nproc-per-node {gpus}`, or make {nproc} GPUs visible with CUDA_VISIBLE_DEVICES{_visible_now(environ)}"
    )
    return Placement("cpu", {"CUDA_VISIBLE_DEVICES": ""}, note)


def require_gpu(local_rank: int, gpus: int, environ: Mapping[str, str] = os.environ) -> None:
    """Raise :class:`DeviceError` unless GPU ``local_rank`` exists among the ``gpus`` this process sees."""
    if local_rank < gpus:
        return
    if gpus == 0:
        raise DeviceError(
            f"init_distributed: backend `nccl` needs a CUDA GPU, but torch {torch.__version__} sees none"
            f"{_visible_now(environ)}: leave `backend` unset (gloo on the CPU) or run where a GPU is visible"
        )
    raise DeviceError(
        f"init_distributed: LOCAL_RANK {local_rank} needs GPU {local_rank}, but this process sees {gpus} "
        f"GPU{'s' if gpus > 1 else ''}{_visible_now(environ)}: start at most {gpus} rank(s) per node "
        f"(`--nproc-per-node {gpus}`), make more GPUs visible, or launch with `shardwise run`, which runs the ranks "
        "on the CPU with gloo when there are fewer GPUs than ranks"
    )
