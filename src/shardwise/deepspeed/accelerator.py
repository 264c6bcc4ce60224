"""`get_accelerator()`: DeepSpeed's device abstraction, for the CPU and CUDA (docs/from-deepspeed.md).

DeepSpeed client scripts ask it for the device name, count and backend instead of calling `torch.cuda` directly, which
is what lets the same script run on a CPU-only machine. The accelerator is CUDA when torch sees a GPU, else the CPU;
`DS_ACCELERATOR` (`cpu` or `cuda`) chooses, as in DeepSpeed. On the CPU, device-only operations do nothing.
"""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch

__all__ = ["Accelerator", "CpuAccelerator", "CudaAccelerator", "get_accelerator", "set_accelerator"]


class Accelerator:
    """What both accelerators share: seeding, dtypes and the naming scheme."""

    _name = "base"
    _communication_backend_name = "gloo"

    def device_name(self, device_index: int | None = None) -> str:
        """`"cpu"` / `"cuda"`, or `"cuda:N"` for an index (a CPU has no index)."""
        return self._name if device_index is None else f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def current_device_name(self) -> str:
        return self.device_name(self.current_device())

    def current_device(self) -> int:
        raise NotImplementedError

    def communication_backend_name(self) -> str:
        """The torch.distributed backend for this device: `nccl` for CUDA, `gloo` for the CPU."""
        return self._communication_backend_name

    def random(self) -> ModuleType:
        return torch.random

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def is_fp16_supported(self) -> bool:
        return True

    def is_bf16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        halves = ((torch.float16, self.is_fp16_supported()), (torch.bfloat16, self.is_bf16_supported()))
        return [torch.float32, *(dtype for dtype, supported in halves if supported)]

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if torch.cuda.is_available() else False

    def lazy_call(self, callback: Callable[[], Any]) -> None:
        callback()

    def range_push(self, msg: str) -> None:
        """Open a profiler range (NVTX on CUDA; nothing on the CPU)."""

    def range_pop(self) -> None:
        """Close the innermost profiler range."""

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        yield

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self._name!r}, backend={self._communication_backend_name!r})"


class CpuAccelerator(Accelerator):
    """The CPU as DeepSpeed's `cpu` accelerator: one device, gloo, memory read from the process."""

    _name = "cpu"

    def device_name(self, device_index: int | None = None) -> str:
        return "cpu"  # DeepSpeed scripts pass a local rank; the CPU has no per-rank index

    def is_available(self) -> bool:
        return True

    def is_synchronized_device(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        # DeepSpeed's CPU accelerator counts one device per local process.
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    def set_device(self, device_index: int) -> None:
        """Nothing to choose on the CPU."""

    def synchronize(self, device_index: int | None = None) -> None:
        """CPU work is already done when the call returns."""

    def empty_cache(self) -> None:
        """The CPU allocator keeps no cache to empty."""

    def memory_allocated(self, device_index: int | None = None) -> int:
        """This process's resident memory in bytes (Linux), else 0."""
        try:
            with open("/proc/self/statm", encoding="ascii") as statm:
                return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """This process's peak resident memory in bytes."""
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        """The kernel keeps the process peak; it cannot be reset."""

    def total_memory(self, device_index: int | None = None) -> int:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    def available_memory(self, device_index: int | None = None) -> int:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


class CudaAccelerator(Accelerator):
    """CUDA through `torch.cuda`, with NCCL."""

    _name = "cuda"
    _communication_backend_name = "nccl"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def is_synchronized_device(self) -> bool:
        return False

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def random(self) -> ModuleType:
        return torch.cuda.random

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.get_device_properties(device_index or 0).total_memory

    def available_memory(self, device_index: int | None = None) -> int:
        free, _ = torch.cuda.mem_get_info(device_index)
        return free

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory()

    def range_push(self, msg: str) -> None:
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        torch.cuda.nvtx.range_pop()

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        with torch.cuda.stream(stream):
            yield

    def lazy_call(self, callback: Callable[[], Any]) -> None:
        torch.cuda._lazy_call(callback)


_KINDS: dict[str, type[Accelerator]] = {"cpu": CpuAccelerator, "cuda": CudaAccelerator}
_current: Accelerator | None = None


def _choose() -> Accelerator:
    wanted = os.environ.get("DS_ACCELERATOR")
    if wanted is None:
        return CudaAccelerator() if torch.cuda.is_available() else CpuAccelerator()
    if wanted not in _KINDS:
        raise ValueError(f"DS_ACCELERATOR={wanted!r}: shardwise supports {sorted(_KINDS)}; "
                         "unset it to pick CUDA when available, else the CPU")
    if wanted == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("DS_ACCELERATOR=cuda, but torch sees no CUDA device; unset it or set it to `cpu`")
    return _KINDS[wanted]()


def get_accelerator() -> Accelerator:
    """The accelerator of this process (chosen once: CUDA when torch sees a GPU, else the CPU)."""
    global _current
    if _current is None:
        _current = _choose()
    return _current


def set_accelerator(accelerator: Accelerator) -> None:
    """Use `accelerator` from now on (DeepSpeed's hook for a custom one)."""
    global _current
    _current = accelerator
