"""Writing a full ``state_dict`` to one file: safetensors or ``torch.save``.

safetensors refuses tensors that share storage, so tied weights are stored once and the other names are recorded in
the file's metadata (``shardwise_aliases``); :func:`shardwise.checkpoint.load_consolidated` puts them back.
``torch.save`` keeps the sharing as it is.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch
from safetensors.torch import save

from ..checkpoint.commit import write_atomic

__all__ = ["ALIASES_KEY", "KEYS_KEY", "save_state_dict", "tied_aliases"]

ALIASES_KEY = "shardwise_aliases"
KEYS_KEY = "shardwise_keys"


def _same_values(tensor: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]:
    """Equal for two tensors that view the same elements (``state_dict()`` gives tied weights as two objects)."""
    storage = tensor.untyped_storage().data_ptr() if tensor.numel() else id(tensor)
    return storage, int(tensor.storage_offset()), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype


def tied_aliases(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """``{name: first name}`` for every entry that views the same elements as an earlier one."""
    first: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype], str] = {}
    aliases = {}
    for name, tensor in state.items():
        key = _same_values(tensor)
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def save_state_dict(state: dict[str, torch.Tensor], path: Path) -> None:
    """Write ``state`` to ``path`` atomically: ``.safetensors`` as safetensors, anything else with ``torch.save``."""
    path = Path(path)
    if path.suffix.lower() == ".safetensors":
        aliases = tied_aliases(state)
        unique = {k: v.contiguous() for k, v in state.items() if k not in aliases}
        metadata = {"format": "pt", ALIASES_KEY: json.dumps(aliases), KEYS_KEY: json.dumps(list(state))}
        data = save(unique, metadata=metadata)
    else:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data)
