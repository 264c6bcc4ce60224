"""``shardwise env``: what a bug report needs: versions, backends, cores and GPUs."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys

import torch
import torch.distributed as dist

__all__ = ["describe_environment"]

_PACKAGES = ("shardwise", "torch", "numpy", "pydantic", "PyYAML", "safetensors", "tqdm", "matplotlib", "tensorboard",
             "transformers")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _backends() -> str:
    checks = {"gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available, "mpi": dist.is_mpi_available}
    return ", ".join(f"{name} {'yes' if check() else 'no'}" for name, check in checks.items())


def _gpus() -> str:
    if not torch.cuda.is_available():
        return f"none (CUDA not available; torch built with CUDA {torch.version.cuda or 'none'})"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return f"{len(names)} (CUDA {torch.version.cuda}): " + ", ".join(names)


def _cores() -> str:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{usable} usable of {os.cpu_count()}; torch threads {torch.get_num_threads()}"


def describe_environment() -> str:
    """Several ``name: value`` lines describing this machine and install."""
    rows = [
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("platform", platform.platform()),
        ("packages", ", ".join(f"{p} {_version(p)}" for p in _PACKAGES)),
        ("distributed backends", _backends()),
        ("default backend", "nccl" if torch.cuda.is_available() else "gloo"),
        ("CPU cores", _cores()),
        ("GPUs", _gpus()),
    ]
    return "\n".join(f"{name}: {value}" for name, value in rows)
