"""The flat stages' side of the master store: their parameters in one flat buffer, this rank's slice of it.

For a layout (:class:`~.layout.FlatLayout`) the trainable parameters become views of one flat buffer of the
compute dtype, bucket after bucket, so that this rank's slice of each bucket is where its updated values go
and one all-gather per bucket, in place, brings the others' (:meth:`FlatSide.gather_pairs`).  In fp32 that
slice is the masters itself: the store's :class:`~.store.Resident` home steps it in place and nothing is
copied.  With one shard and the gradients in ``param.grad`` (stage 0 in fp32) the parameters keep their own
storage and are stepped themselves, as in plain DDP (:attr:`FlatSide.whole`).  A frozen parameter keeps its
own storage too; the store keeps its master whole, replicated (a rank cannot know which piece of it it will
own once it trains again).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from ..store.home import Piece, Runs
from .layout import FlatLayout

__all__ = ["FlatSide"]


class FlatSide:
    """The model's parameters for ``layout`` (see the module docstring); ``whole``: they are stepped themselves."""

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device, whole: bool) -> None:
        self.layout = layout
        self.whole = whole
        #: the model's flat parameter buffer (empty when the parameters are not flattened)
        self.param_flat = torch.empty(0)
        if not whole:
            self._flatten(dtype, device)

    def _flatten(self, dtype: torch.dtype, device: torch.device) -> None:
        """Move every trainable parameter into one flat buffer of ``dtype`` (they become views of it)."""
        layout = self.layout
        self.param_flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
        for index, param in enumerate(layout.params):
            view = layout.param_slice(self.param_flat, index)
            view.copy_(param.detach().reshape(-1))
            param.data = view.view_as(param)

    def pieces(self, names: dict[int, str], groups: dict[int, int], frozen: Sequence[nn.Parameter]) -> list[Piece]:
        """The store's pieces: this rank's part of each trainable parameter, in shard order, then each frozen
        parameter whole."""
        layout, pieces = self.layout, []
        for run in layout.pieces:
            param = layout.params[run.param]
            pieces.append(Piece(param, names[id(param)], param.shape, run.start, run.end, run.shard_offset,
                                groups[id(param)], run.param))
        for param in frozen:
            pieces.append(Piece(param, names[id(param)], param.shape, 0, param.numel(), -1, groups[id(param)], -1))
        return pieces

    def view(self, piece: Piece) -> Optional[torch.Tensor]:
        if piece.at < 0:
            return None  # frozen: its master is kept apart, whole
        return piece.param if self.whole else self._region(piece)

    def _region(self, piece: Piece) -> torch.Tensor:
        """The piece's elements of the model's parameter (in the flat buffer where it was flattened)."""
        if piece.at < 0 or self.whole:
            return piece.param.detach().view(-1).narrow(0, piece.start, piece.numel)
        return self.layout.param_slice(self.param_flat, piece.index).narrow(0, piece.start, piece.numel)

    def values(self, piece: Piece) -> torch.Tensor:
        return piece.param.detach().reshape(-1).narrow(0, piece.start, piece.numel).to(torch.float32, copy=True)

    def write(self, runs: Runs) -> None:
        """Into this rank's slice of the flat buffer (then all-gathered), or a frozen parameter itself."""
        for piece, at, values in runs:
            target = self._region(piece).narrow(0, at, values.numel())
            if target.data_ptr() != values.data_ptr():
                target.copy_(values, non_blocking=True)  # from pinned staging (host offload): not waited for

    def settle(self) -> None:
        pass  # nothing is held between writes

    def gather_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per bucket: (the model's region of it, this rank's slice inside that region), fixed views; none with
        one shard (the step wrote every parameter).  After the step this rank's slice holds its updated values,
        so an all-gather of each pair, in place, re-assembles the updated parameters."""
        layout, flat = self.layout, self.param_flat
        if self.whole or layout.num_shards == 1:
            return []
        return [(layout.bucket_slice(flat, b), layout.owned_slice(flat, b)) for b in layout.buckets]

    def release(self) -> None:
        """Give every parameter its own storage again (before the layout is rebuilt)."""
        if not self.whole:
            for param in self.layout.params:
                param.data = param.data.clone()
