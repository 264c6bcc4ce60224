"""`deepspeed.runtime.dataloader.RepeatingLoader` (Megatron-DeepSpeed imports it from here)."""

from __future__ import annotations

from ..utils import RepeatingLoader

__all__ = ["RepeatingLoader"]
