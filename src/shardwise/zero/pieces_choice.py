"""The one choice of stage 3's pieces arrangement (:mod:`.pieces`, :mod:`.offloaded_pieces`), made at initialize.

Apart from the arrangements so that the offloaded one, in a module of its own, and the two in
:mod:`.pieces` are all picked here without an import cycle (as :func:`~.masters.choose_masters` does
for the flat stages).
"""

from __future__ import annotations

from typing import Optional

import torch

from .offloaded_pieces import OffloadedPieces
from .pieces import Pieces, SeparateMasters, ShardsAreMasters
from .store.plan import OffloadSpec

__all__ = ["choose_pieces"]


def choose_pieces(dtype: torch.dtype, rank: int, offload: Optional[OffloadSpec] = None,
                  shards_in_files: bool = False) -> Pieces:
    """Masters and optimizer state in files where ``offload`` asks for NVMe; else, in fp32, the shards are the
    masters, unless the shards themselves live in files (``offload_param: nvme``: a master that is a view of
    a shard would leave host memory with it), and otherwise the masters are separate fp32 copies."""
    if offload is not None:
        return OffloadedPieces(rank, offload)
    if dtype == torch.float32 and not shards_in_files:
        return ShardsAreMasters(rank)
    return SeparateMasters(rank)
