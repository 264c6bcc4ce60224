"""``shardwise checkpoint inspect|consolidate|export``: work with checkpoints from one CPU process, no cluster."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from .files import CheckpointError

__all__ = ["add_checkpoint_commands"]


def _refusing(action: str, run: Callable[[argparse.Namespace], Any]) -> Callable[[argparse.Namespace], int]:
    """``run`` as a handler: a bad checkpoint is refused with its message on one line (exit 2), not a traceback."""
    def handler(ns: argparse.Namespace) -> int:
        try:
            run(ns)
        except (CheckpointError, OSError) as error:
            print(f"shardwise checkpoint {action}: {' '.join(str(error).split())}", file=sys.stderr)
            return 2
        return 0

    return handler


def _inspect(ns: argparse.Namespace) -> None:
    from .consolidation import describe  # here: it imports DCP (~1.4 s), which `shardwise run` does not need

    print(describe(ns.ckpt_dir))


def _consolidate(ns: argparse.Namespace) -> None:
    from .consolidation import consolidate  # here: it imports DCP (~1.4 s), which `shardwise run` does not need

    summary = consolidate(ns.ckpt_dir, ns.out, tag=ns.tag, engine=ns.engine)
    tied = ", ".join(f"{alias} -> {name}" for alias, name in summary["aliases"].items()) or "none"
    print(
        f"wrote {summary['file']}: {summary['tensors']} tensors, {summary['elements']:,} elements (fp32), "
        f"{summary['bytes'] / 2**20:.1f} MiB; tied names stored once: {tied}"
    )


def _export(ns: argparse.Namespace) -> None:
    # here: it imports DCP (~1.4 s), which `shardwise run` does not need
    from ..model_io.pretrained import export_pretrained

    configs = export_pretrained(ns.ckpt_dir, ns.out_dir, tag=ns.tag, engine=ns.engine, config=ns.config)
    if configs:
        print(f"wrote {ns.out_dir}: model.safetensors and {', '.join(p.name for p in configs)} (from "
              f"{configs[0].parent}); `from_pretrained({ns.out_dir!r})` loads it")
    else:
        print(f"wrote {ns.out_dir}/model.safetensors; no Hugging Face config.json was found beside the checkpoint: "
              "pass `--config` (the model's config.json or its folder) so `from_pretrained` can load the folder")


def add_checkpoint_commands(subparsers: Any) -> None:
    """Add ``shardwise checkpoint`` (``inspect``, ``consolidate``, ``export``) to the ``shardwise`` parser."""
    parser = subparsers.add_parser("checkpoint", help="inspect or consolidate shardwise checkpoints")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    inspect = actions.add_parser(
        "inspect",
        help="list the checkpoints in a directory",
        description="Print every checkpoint in CKPT_DIR (the `save_dir` of `save_checkpoint`, or one checkpoint "
        "directory): tag, world size, ZeRO stage, dtype, step, tensor counts and sizes; unfinished saves are "
        "marked INCOMPLETE. Exit 0, or 2 with the problem on stderr.",
    )
    inspect.add_argument("ckpt_dir", metavar="CKPT_DIR")
    inspect.set_defaults(handler=_refusing("inspect", _inspect))
    consolidate = actions.add_parser(
        "consolidate",
        help="write a checkpoint's full fp32 weights to one file",
        description="Put the sharded weights of a checkpoint together in this process (no process group) and "
        "write them as FILE (.safetensors or .pt). Tied weights are stored once; "
        "`shardwise.checkpoint.load_consolidated(FILE)` returns a state_dict for `model.load_state_dict`. "
        "Exit 0, or 2 with the problem on stderr.",
    )
    consolidate.add_argument("ckpt_dir", metavar="CKPT_DIR")
    _add_choice(consolidate)
    consolidate.add_argument("--out", required=True, metavar="FILE", help="output file, .safetensors or .pt")
    consolidate.set_defaults(handler=_refusing("consolidate", _consolidate))
    export = actions.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face folder (`--hf`)",
        description="Write the full fp32 weights of a checkpoint as OUT_DIR/model.safetensors with the model's "
        "Hugging Face config.json beside it, so `from_pretrained(OUT_DIR)` loads it; from one process, any stage "
        "and world size. The folder appears only once complete. Exit 0, or 2 with the problem on stderr.",
    )
    export.add_argument("--hf", action="store_true", required=True,
                        help="the Hugging Face layout (the only export format)")
    export.add_argument("ckpt_dir", metavar="CKPT_DIR")
    export.add_argument("out_dir", metavar="OUT_DIR")
    _add_choice(export)
    export.add_argument("--config", metavar="PATH", help="the model's config.json, or the folder holding it "
                        "(default: a Hugging Face config.json in CKPT_DIR or the folder above it)")
    export.set_defaults(handler=_refusing("export", _export))


def _add_choice(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tag", help="the checkpoint to export (default: the one `latest` names)")
    parser.add_argument("--engine", help="in a checkpoint of several engines, the one to export")
