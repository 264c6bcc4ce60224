"""A ``torch.save`` file from someone else, bounded before and after ``torch.load`` builds it.

``torch.load`` reads a zip: one pickle (``data.pkl``) and one record per
storage.  Each storage is allocated at the size its record declares in the
zip's central directory, and a deflated record is inflated in full; a tensor
is then a view over its storage with any size and stride the pickle chose.
So, before loading, every record must be stored uncompressed (``torch.save``
never compresses), the records together no longer than the file (stored
records do not overlap) and no longer than the caller's budget; after
loading, every tensor must cover no more elements than its storage holds.  A
stride-0 view (``size 2**40, stride 0`` over 4 bytes) costs nothing to build
but its full size in any copy, ``torch.cat`` or ``.float()``, so it is refused
before one is made.  Reads only the central directory before the load.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any, BinaryIO, Optional

import torch

from .errors import CheckpointError
from .limits import MAX_DIMS

__all__ = ["check_records", "check_views"]


def check_records(stream: BinaryIO, path: Path, budget: Optional[int], over_budget: str) -> None:
    """Raise unless ``stream``'s zip records are stored, do not overlap, and sum to at most ``budget`` bytes.

    ``over_budget`` is the end of the error when the records exceed the budget (what the budget is, the fix).
    """
    size = os.fstat(stream.fileno()).st_size
    try:
        entries = zipfile.ZipFile(stream).infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise CheckpointError(f"{path} is not a `torch.save` file ({exc}); it is damaged or was replaced") from None
    finally:
        stream.seek(0)
    for entry in entries:
        if entry.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(
                f"{path} holds `{entry.filename}` compressed ({entry.compress_size:,} bytes that expand to "
                f"{entry.file_size:,}); `torch.save` never compresses, and shardwise refuses to expand a record "
                "it cannot bound: the file was re-packed or crafted; load the file as it was saved"
            )
    total = sum(entry.file_size for entry in entries)
    if total > size:
        raise CheckpointError(
            f"{path}: its zip records claim {total:,} bytes in a file of {size:,}, so they overlap (one "
            "record's bytes read many times over); `torch.save` never writes that: the file was crafted"
        )
    if budget is not None and total > budget:
        raise CheckpointError(f"{path} holds {total:,} bytes of records, more than {over_budget}")


def check_views(value: Any, path: Path) -> None:
    """Raise if a tensor anywhere in ``value`` (dicts, lists, tuples) covers more elements than its storage."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, where = stack.pop()
        if isinstance(item, torch.Tensor):
            _check_view(item, where, path)
        elif isinstance(item, dict):
            stack.extend((v, f"{where}[{k!r:.40}]") for k, v in item.items())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(item))
        elif hasattr(item, "fields") and isinstance(item.fields, dict):  # a DeepSpeedRecord's fields
            stack.append((item.fields, where))


def _check_view(tensor: torch.Tensor, where: str, path: Path) -> None:
    if tensor.dim() > MAX_DIMS:
        raise CheckpointError(f"{path}: the tensor at `{where}` has {tensor.dim()} dimensions, more than the "
                              f"{MAX_DIMS} any model's tensor has; the file was crafted")
    needed = tensor.numel() * tensor.element_size()
    held = tensor.untyped_storage().nbytes()
    if needed > held:
        raise CheckpointError(
            f"{path}: the tensor at `{where}` is {tuple(tensor.shape)} ({tensor.numel():,} elements, {needed:,} "
            f"bytes once copied) over a storage of {held:,} bytes, with strides {tensor.stride()}: elements share "
            "bytes (a stride-0 view), which `torch.save` of a model's or optimizer's tensor never writes; the file "
            "was crafted or damaged: load the checkpoint as it was saved"
        )
