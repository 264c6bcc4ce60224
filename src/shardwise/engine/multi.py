"""Several engines saved and loaded together: ``shardwise.save_checkpoints`` / ``load_checkpoints``.

Thin wrappers that hand each engine's ``checkpointable()`` view to :mod:`shardwise.checkpoint.group`, which
holds the layout and the atomic commit.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ..faults.announce import register
from .engine import Engine

__all__ = ["load_checkpoints", "save_checkpoints"]


def save_checkpoints(save_dir: Any, engines: Mapping[str, Engine], tag: Optional[str] = None,
                     client_state: Optional[dict[str, Any]] = None) -> str:
    """Collectively save ``{name: engine}`` into ``save_dir/TAG/<name>/`` with one ``latest``; returns ``save_dir/TAG``
    (the rest: :func:`shardwise.checkpoint.save_checkpoints`, which this calls)."""
    from ..checkpoint.group import save_checkpoints as save  # here: the checkpoint layer imports DCP (~1.4 s)

    return save(save_dir, {name: engine.checkpointable() for name, engine in engines.items()}, tag, client_state)


def load_checkpoints(load_dir: Any, engines: Mapping[str, Engine], tag: Optional[str] = None,
                     **options: Any) -> tuple[Optional[str], Optional[dict[str, Any]]]:
    """Collectively restore ``{name: engine}`` from ``load_dir/TAG/<name>/``; returns ``(load_dir/TAG, client_state)``
    (the rest: :func:`shardwise.checkpoint.load_checkpoints`, which this calls)."""
    from ..checkpoint.group import load_checkpoints as load  # here: the checkpoint layer imports DCP (~1.4 s)

    return load(load_dir, {name: engine.checkpointable() for name, engine in engines.items()}, tag, **options)


# announced on the default group by the checkpoint layer (checkpoint/group.py), which is imported on first use
register("save_checkpoints", "save_checkpoints")
register("load_checkpoints", "load_checkpoints")
