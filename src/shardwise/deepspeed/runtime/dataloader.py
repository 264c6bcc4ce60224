"""`deepspeed.runtime.dataloader.RepeatingLoader` (Megatron-DeepSpeed imports it from here)."""

from __future__ import annotations

from ..utils.repeating import RepeatingLoader

__all__ = ["RepeatingLoader"]
