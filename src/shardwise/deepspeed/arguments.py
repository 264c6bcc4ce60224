"""`add_config_arguments`: DeepSpeed's command-line flags, plus a `--local_rank` that torchrun fills."""

from __future__ import annotations

import argparse
import os

__all__ = ["add_config_arguments", "launcher_local_rank"]


def launcher_local_rank() -> int:
    """torchrun's `LOCAL_RANK`, or -1 (DeepSpeed's "not distributed") when no launcher set it."""
    value = os.environ.get("LOCAL_RANK", "")
    return int(value) if value.strip() else -1


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `--deepspeed`, `--deepspeed_config` (and the deprecated `--deepscale*`) and `--local_rank`.

    torchrun passes no `--local_rank`: it sets `LOCAL_RANK`. DeepSpeed client scripts declare
    `--local_rank` with default -1 and branch on `args.local_rank == -1`, which under torchrun
    would silently take the one-process path. So `--local_rank` (also spelled `--local-rank`)
    defaults to `LOCAL_RANK` here, and when the script already declared it, its default becomes
    `LOCAL_RANK` whenever a launcher set it. A value given on the command line still wins.
    """
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (read by shardwise.deepspeed)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed (a flag for the script; shardwise needs no switch)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON (or YAML) config file")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    local_rank = launcher_local_rank()
    try:
        group.add_argument("--local_rank", "--local-rank", type=int, default=local_rank,
                           help="this process's rank on its node (default: torchrun's LOCAL_RANK, else -1)")
    except argparse.ArgumentError:
        # The script declared it already (usually with default -1).
        if local_rank >= 0:
            parser.set_defaults(local_rank=local_rank)
    return parser
