"""`deepspeed.runtime` for client scripts: `utils` (set_random_seed, ...) and `dataloader`."""

from __future__ import annotations

from . import dataloader, utils

__all__ = ["dataloader", "utils"]
