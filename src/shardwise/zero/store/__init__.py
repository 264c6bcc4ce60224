"""This rank's fp32 master weights and optimizer state, for every ZeRO stage, and where they live: the store
(:mod:`.store`) and its homes (:class:`~.store.Resident` in memory, :class:`~.host.Host` in host memory,
:class:`~.nvme.Nvme` in files), chosen once (:func:`choose_home`)."""

from __future__ import annotations

from typing import Optional

import torch

from .copies import DeviceCopies
from .host import Host
from .nvme import Nvme
from .plan import OffloadSpec
from .store import Home, ModelSide, Resident

__all__ = ["choose_home"]


def choose_home(side: ModelSide, offload: Optional[OffloadSpec], fp32_in_memory: bool, device: torch.device,
                dtype: torch.dtype = torch.float32) -> Home:
    """Where the state lives, once, for a model on ``device`` computing in ``dtype``: in files where ``offload``
    asks for NVMe, in host memory where it asks for ``cpu`` (both with copies to and from the device where the
    model is not in host memory: ``offload.copies``); else in memory, the masters the model's own storage where
    it holds fp32 values in memory."""
    if offload is None:
        return Resident(side, fp32_in_memory)
    copies = DeviceCopies(device, dtype, offload.pin_memory)
    if offload.device == "cpu":  # (asked for only where it moves the state: `offload.copies`)
        return Host(side, offload, copies, Resident(side, fp32_in_memory))
    return Nvme(side, offload, pin=offload.pin_memory and device.type == "cuda", copies=copies if offload.copies else None)
