"""Facts about the CPU that change what a config costs: native bf16 or not.

On an x86 CPU without ``avx512_bf16`` or AMX, torch runs bf16 matrix products through conversions to fp32 and back,
an order of magnitude slower than fp32 (measured on this project's 2-core machines).  A bf16 config that was meant
to speed training up then slows it down, silently.  :func:`warn_if_slow_bf16` says so once per process at
``initialize``, with the factor measured there.
"""

from __future__ import annotations

import functools
import logging
import platform
import time
from pathlib import Path

import torch

__all__ = ["bf16_slowdown", "bf16_support", "cpu_description", "cpu_model", "native_bf16", "warn_if_slow_bf16"]

logger = logging.getLogger("shardwise")

_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
#: warn when bf16 matrix products take this many times as long as fp32 ones
_SLOW = 2.0


def _cpuinfo(field: str) -> str | None:
    """The first ``field`` line's value in /proc/cpuinfo (None where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field):
            return line.split(":", 1)[1].strip()
    return None


def cpu_model() -> str:
    """The CPU's model name."""
    return _cpuinfo("model name") or platform.processor() or platform.machine() or "unknown"


@functools.lru_cache(maxsize=1)
def native_bf16() -> bool | None:
    """Whether this x86 CPU has native bf16 (``avx512_bf16`` / AMX); None where the flags cannot be read."""
    flags = set((_cpuinfo("flags") or "").split())
    if not flags:
        return None
    return any(flag in flags for flag in _BF16_FLAGS)


def bf16_support() -> str:
    """``native bf16``, ``no native bf16`` or ``bf16 support unknown``: what benchmark reports print by bf16 figures."""
    return {True: "native bf16", False: "no native bf16", None: "bf16 support unknown"}[native_bf16()]


def cpu_description() -> str:
    """The CPU model and its bf16 support."""
    return f"{cpu_model()}, {bf16_support()}"


@functools.lru_cache(maxsize=1)
def bf16_slowdown(size: int = 256, repeats: int = 8) -> float:
    """How many times longer a ``size``-square bf16 matmul takes than fp32 on this CPU (best of ``repeats``)."""
    a = torch.randn(size, size)
    times = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = a.to(dtype)
        x @ x  # warm-up: first calls pick kernels
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            x @ x
            best = min(best, time.perf_counter() - start)
        times[dtype] = best
    return times[torch.bfloat16] / max(times[torch.float32], 1e-9)


_WARNED: list[bool] = []


def warn_if_slow_bf16(dtype: torch.dtype, device: torch.device, rank: int) -> None:
    """Once per process: bf16 on a CPU without native bf16 is said, with the measured slowdown."""
    if _WARNED or dtype != torch.bfloat16 or device.type != "cpu" or native_bf16() is not False:
        return
    _WARNED.append(True)
    factor = bf16_slowdown()
    if factor < _SLOW or rank != 0:
        return
    logger.warning(
        "bf16 is enabled on a CPU without native bf16 (%s): a bf16 matrix product measured %.1fx the time of "
        "an fp32 one here, so this run will likely be slower than fp32; set `bf16.enabled: false` on this machine "
        "or run on a CPU with avx512_bf16/AMX or a GPU", cpu_model(), factor)
