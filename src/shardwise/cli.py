"""The ``shardwise`` console command.

``shardwise run`` builds arguments for ``torch.distributed.run`` (torchrun) and
delegates; it launches nothing itself (Lightning Fabric's CLI is the model).
``shardwise config validate`` checks a config file and prints it resolved.

Commands live in a registry, :data:`COMMANDS`: each entry adds its subparser
and sets a ``handler``. A new command (``shardwise checkpoint inspect`` /
``consolidate``) is one function decorated with :func:`command`; see the note
at the end of the command section.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

__all__ = ["COMMANDS", "build_parser", "command", "main", "torchrun_args"]

# A command builder receives the `add_subparsers()` object of `shardwise`
# (argparse gives its type no public name, hence Any).
AddCommand = Callable[[Any], None]

# name -> function that adds the command's parser (with `handler` set by
# `set_defaults(handler=...)`, a function `Namespace -> exit code`).
COMMANDS: dict[str, AddCommand] = {}


def command(name: str) -> Callable[[AddCommand], AddCommand]:
    """Register ``add(subparsers)`` as the builder of ``shardwise <name>``."""

    def register(add: AddCommand) -> AddCommand:
        if name in COMMANDS:
            raise ValueError(f"`shardwise {name}` is already registered by {COMMANDS[name].__qualname__}")
        COMMANDS[name] = add
        return add

    return register


# ----------------------------------------------------------------- shardwise run

# torchrun options that choose a rendezvous; if the user gave none of them on
# one node, `--standalone` makes the launch work with no setup.
_RENDEZVOUS_DESTS = (
    "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "master_addr", "master_port", "standalone",
)
_UNSET = object()


def _parse_torchrun(args: Sequence[str]) -> argparse.Namespace:
    """Parse ``args`` with torchrun's own parser; rendezvous options left out read as ``_UNSET``."""
    from torch.distributed import run as torchrun

    parser = torchrun.get_args_parser()
    parser.prog = "shardwise run"
    # A sentinel default tells "not given" apart from "given the default value".
    parser.set_defaults(**{dest: _UNSET for dest in _RENDEZVOUS_DESTS})
    return parser.parse_args(list(args))


def _rendezvous_given(parsed: argparse.Namespace) -> bool:
    """Whether the command line or torchrun's ``PET_*`` environment picks a rendezvous."""
    on_command_line = any(getattr(parsed, dest) is not _UNSET for dest in _RENDEZVOUS_DESTS)
    in_environment = any(f"PET_{dest.upper()}" in os.environ for dest in _RENDEZVOUS_DESTS)
    return on_command_line or in_environment


def torchrun_args(args: Sequence[str]) -> list[str]:
    """The argument list for ``torch.distributed.run.main``: ``args`` plus ``--standalone`` when needed.

    ``--standalone`` is added only on a single node (``--nnodes`` 1) with no
    rendezvous option given, so every explicit multi-node setup passes through
    untouched. Bad arguments exit with torchrun's usage message (status 2).
    """
    from torch.distributed import run as torchrun

    parsed = _parse_torchrun(args)
    _, max_nodes = torchrun.parse_min_max_nnodes(parsed.nnodes)
    if max_nodes == 1 and not _rendezvous_given(parsed):
        return ["--standalone", *args]
    return list(args)


def _exit_code(error: BaseException) -> int:
    """The failed script's exit status, or 1 when it died by a signal or gave none."""
    failures = getattr(error, "failures", {})
    codes = [getattr(f, "exitcode", 1) for f in failures.values()]
    code = next((c for c in codes if c != 0), 1)
    return code if 0 < code < 256 else 1


def _run(ns: argparse.Namespace) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun.main(torchrun_args(ns.args))
    except ChildFailedError as error:
        # torchrun has already logged each failed rank; exit with the script's status.
        print(f"shardwise run: {error}", file=sys.stderr)
        return _exit_code(error)
    return 0


@command("run")
def _add_run(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run",
        help="launch a script on several processes via torch.distributed.run (torchrun)",
        description="shardwise run [torchrun options] script.py [script args]: every argument goes "
        "to torchrun; `--standalone` is added on one node when no rendezvous option is given. "
        "`shardwise run --help` shows torchrun's options.",
        add_help=False,
        # No option prefix: every argument, `--help` included, belongs to torchrun.
        prefix_chars=" ",
    )
    parser.add_argument("args", nargs=argparse.REMAINDER)
    parser.set_defaults(handler=_run)


# ------------------------------------------------------- shardwise config validate


def _top_level(path: Path) -> Any:
    """The file's parsed top level, or None when it cannot be read (Config.load then says why)."""
    from shardwise.config import ConfigError, read_config_file

    try:
        return read_config_file(path)
    except ConfigError:
        return None


def _resolved(config: Any, world_size: int) -> dict[str, Any]:
    """``config`` as a dict with its batch sizes resolved for ``world_size`` (``auto`` where still pending)."""
    sizes = config.batch_sizes(world_size)
    data: dict[str, Any] = config.to_dict()
    data["train_batch_size"] = sizes.train_batch_size
    data["train_micro_batch_size_per_gpu"] = sizes.micro_batch_size
    data["gradient_accumulation_steps"] = sizes.gradient_accumulation_steps
    return data


def _explained(config: Any, name: str | None = None) -> list[str]:
    """The info lines about ``config``: what was ignored or read differently, and how each ``auto`` resolves."""
    where = f"engines.{name}: " if name is not None else ""
    lines = [f"note: {where}{note}" for note in config.notes]
    lines += [f"note: {where}`{path}: auto` resolves at initialize: {how}" for path, how in config.pending.items()]
    return lines


def _render(data: dict[str, Any], fmt: str, header: str) -> str:
    if fmt == "json":
        return json.dumps(data, indent=2)
    return f"# {header}\n" + yaml.safe_dump(data, sort_keys=False)


def _validate(ns: argparse.Namespace) -> int:
    from shardwise.config import Config, ConfigError, load_configs

    path = Path(ns.file)
    fmt = ns.format or ("json" if path.suffix.lower() == ".json" else "yaml")
    top = _top_level(path)
    try:
        if isinstance(top, dict) and "engines" in top:
            configs = load_configs(path)
            data = {"engines": {name: _resolved(c, ns.world_size) for name, c in configs.items()}}
            notes = [line for name, c in configs.items() for line in _explained(c, name)]
        else:
            config = Config.load(path)
            data, notes = _resolved(config, ns.world_size), _explained(config)
    except ConfigError as error:
        print(error, file=sys.stderr)
        return 2
    # The config goes to stdout (still a valid file); the notes go to stderr.
    for line in notes:
        print(line, file=sys.stderr)
    print(_render(data, fmt, f"{path}: valid; batch sizes resolved for world_size {ns.world_size}"))
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"got {value}; expected an integer >= 1")
    return value


@command("config")
def _add_config(subparsers: Any) -> None:
    parser = subparsers.add_parser("config", help="work with shardwise config files")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    validate = actions.add_parser(
        "validate",
        help="check a config file and print it resolved",
        description="Validate FILE (.json/.yaml; a file with `engines:` validates each named config) "
        "and print every setting, with the batch sizes resolved for --world-size. On stderr, one note per "
        "DeepSpeed key accepted and ignored (and why), alias read, and `auto` value (what it became, or "
        "how it resolves at initialize). Exit 0 when valid, 2 with the problems on stderr when not.",
    )
    validate.add_argument("file", metavar="FILE")
    validate.add_argument(
        "--world-size", type=_positive_int, default=1, help="ranks to resolve batch sizes for (default 1)"
    )
    validate.add_argument("--format", choices=("yaml", "json"), help="output format (default: the file's)")
    validate.set_defaults(handler=_validate)


# More commands go here: an `@command(name)` function, or a builder from the
# module that owns the feature registered with `command(name)(builder)`.
from .checkpoint.cli import add_checkpoint_commands  # noqa: E402 - registered with the others

command("checkpoint")(add_checkpoint_commands)


# ------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """The ``shardwise`` parser with every registered command."""
    parser = argparse.ArgumentParser(prog="shardwise", description="shardwise: data-parallel training with ZeRO.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS.values():
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``shardwise`` with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    ns = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    handler: Callable[[argparse.Namespace], int] = ns.handler
    return handler(ns)


if __name__ == "__main__":
    raise SystemExit(main())
