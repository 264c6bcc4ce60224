"""Writing a full ``state_dict`` to one file: safetensors or ``torch.save``.

safetensors refuses tensors that share storage, so tied weights are stored
once and the other names are recorded in the file's metadata
(``shardwise_aliases``); :func:`shardwise.checkpoint.load_consolidated` puts
them back.  ``torch.save`` keeps the sharing as it is.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch

__all__ = ["ALIASES_KEY", "KEYS_KEY", "save_state_dict", "tied_aliases"]

ALIASES_KEY = "shardwise_aliases"
KEYS_KEY = "shardwise_keys"


def tied_aliases(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """``{name: first name}`` for every entry that is the same tensor as an earlier one."""
    first: dict[int, str] = {}
    aliases = {}
    for name, tensor in state.items():
        if id(tensor) in first:
            aliases[name] = first[id(tensor)]
        else:
            first[id(tensor)] = name
    return aliases


def save_state_dict(state: dict[str, torch.Tensor], path: Path) -> None:
    """Write ``state`` to ``path`` atomically: ``.safetensors`` as safetensors, anything else with ``torch.save``."""
    from .checkpoint.commit import write_atomic

    path = Path(path)
    if path.suffix.lower() == ".safetensors":
        from safetensors.torch import save

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
