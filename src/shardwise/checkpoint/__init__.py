"""Sharded, atomic, reshardable checkpoints (see ``docs/checkpoints.md``).

``engine.save_checkpoint`` / ``engine.load_checkpoint`` call :func:`save_checkpoint` / :func:`load_checkpoint`.
Without a cluster, :func:`consolidate` writes a checkpoint's full weights to one ``.safetensors``/``.pt`` file,
:func:`load_consolidated` reads it back as a ``state_dict``, and :func:`describe` summarises a checkpoint
directory (``shardwise checkpoint consolidate|inspect``).  Names are imported on first use: DCP takes seconds to
import, which ``shardwise run`` should not pay for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "CheckpointError", "consolidate", "consolidated_client_state", "consolidated_state_dict", "describe",
    "load_checkpoint", "load_checkpoints", "load_consolidated", "save_checkpoint", "save_checkpoints",
]

_MODULES = {
    ".files": ["CheckpointError"],
    ".consolidation": [
        "consolidate", "consolidated_client_state", "consolidated_state_dict", "describe", "load_consolidated",
    ],
    ".group": ["load_checkpoints", "save_checkpoint", "save_checkpoints"],
    ".load": ["load_checkpoint"],
}
_WHERE = {name: module for module, names in _MODULES.items() for name in names}

if TYPE_CHECKING:
    from .consolidation import (
        consolidate,
        consolidated_client_state,
        consolidated_state_dict,
        describe,
        load_consolidated,
    )
    from .files import CheckpointError
    from .group import load_checkpoints, save_checkpoint, save_checkpoints
    from .load import load_checkpoint


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module `shardwise.checkpoint` has no attribute `{name}`")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
