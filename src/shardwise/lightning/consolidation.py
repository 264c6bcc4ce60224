"""A Lightning checkpoint directory from ``ShardwiseStrategy`` as one ``.ckpt`` file of full fp32 weights.

The counterpart of Lightning's ``convert_zero_checkpoint_to_fp32_state_dict`` for DeepSpeed: one CPU
process, no process group. The file is Lightning's own format, the checkpoint's Lightning state (loops,
callbacks, hyperparameters, ...) with ``state_dict`` filled in, so ``MyModule.load_from_checkpoint(file)``
and ``torch.load(file)["state_dict"]`` both work.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch

from shardwise.checkpoint import consolidated_client_state, consolidated_state_dict

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict"]

PathLike = Union[str, "os.PathLike[str]"]


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: PathLike, output_file: PathLike,
                                               tag: Optional[str] = None) -> dict[str, Any]:
    """Write the checkpoint in ``checkpoint_dir`` (the directory ``trainer.save_checkpoint`` wrote) to
    ``output_file`` with full fp32 weights under ``state_dict``; returns what it wrote. ``tag`` picks one
    checkpoint of several (default: ``latest``). Lightning's state that needed pickle
    (``checkpoint.allow_pickle``) is refused here too: load such a checkpoint with the Trainer instead."""
    state = consolidated_client_state(checkpoint_dir, tag)
    state["state_dict"] = consolidated_state_dict(checkpoint_dir, tag)
    torch.save(state, output_file)
    return state
