"""Facts about the CPU that change what a config costs: native bf16 or not.

On an x86 CPU without ``avx512_bf16`` or AMX, torch runs bf16 matrix products
through conversions to fp32 and back, an order of magnitude slower than fp32
(measured on this project's 2-core machines).  A bf16 config that was meant to
speed training up then slows it down, silently.  :func:`warn_if_slow_bf16`
says so once per process at ``initialize``, with the factor measured there.
"""

from __future__ import annotations

import functools
import logging
import platform
import time
from pathlib import Path

import torch

__all__ = ["bf16_slowdown", "cpu_description", "native_bf16", "warn_if_slow_bf16"]

logger = logging.getLogger("shardwise")

_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
#: warn when bf16 matrix products take this many times as long as fp32 ones
_SLOW = 2.0


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=1)
def native_bf16() -> bool | None:
    """Whether this x86 CPU has native bf16 (``avx512_bf16`` / AMX); None where the flags cannot be read."""
    flags = _cpu_flags()
    if not flags:
        return None
    return any(flag in flags for flag in _BF16_FLAGS)


def cpu_description() -> str:
    """The CPU model and its bf16 support, as benchmark reports print next to bf16 figures."""
    native = native_bf16()
    support = {True: "native bf16", False: "no native bf16 (no avx512_bf16/AMX)", None: "bf16 support unknown"}
    return f"{_cpu_model()}, {support[native]}"


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
        "or run on a CPU with avx512_bf16/AMX or a GPU", _cpu_model(), factor)
