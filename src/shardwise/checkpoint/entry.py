"""The checkpoint layer's front door for one engine: a named engine goes to the group code, any other to save.py.

A named engine's files live in ``TAG/<name>/`` next to those of the other
engines of its tag (``group.py``), so its ``save_checkpoint`` is a save of a
group of one; an engine without a name owns ``TAG/`` (``save.py``).  Loading
needs no such choice: ``load.py`` finds ``TAG/<name>/`` through
``layout.member_path``.  Choosing here keeps the layers one-way: group.py
imports save.py and load.py, and neither imports group.py.
"""

from __future__ import annotations

from typing import Any, Optional

from .group import save_checkpoints
from .load import load_checkpoint
from .protocol import Checkpointable
from .save import save_unnamed

__all__ = ["load_checkpoint", "save_checkpoint"]


def save_checkpoint(
    engine: Checkpointable, save_dir: Any, tag: Optional[str] = None, client_state: Optional[dict[str, Any]] = None
) -> str:
    """Collectively write a checkpoint of ``engine`` to ``save_dir/tag``; returns that path.

    ``tag`` defaults to ``global_step{engine.global_steps}``.  ``client_state``
    (plain values and tensors; as passed on rank 0) comes back from
    :func:`~shardwise.checkpoint.load_checkpoint`.
    """
    if engine.name is not None:  # a named engine's files live under its name: TAG/<name>/
        return save_checkpoints(save_dir, {engine.name: engine}, tag, client_state, comm=engine.comm)
    return save_unnamed(engine, save_dir, tag, client_state)
