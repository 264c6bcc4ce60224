"""The ``shardwise`` console command.

``shardwise run`` builds arguments for ``torch.distributed.run`` (torchrun) and delegates, launching nothing
itself (Lightning Fabric's CLI is the model); ``config validate`` checks a config file and prints it resolved;
``generate`` samples from a trained example model, ``env`` prints what a bug report needs, ``plot`` draws a
Trainer's metrics.  Each command is one function registered with :func:`command` in :data:`COMMANDS`, which adds
its subparser and sets a ``handler``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import yaml
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from .._version import __version__
from ..comm.placement import plan_placement, visible_gpus
from ..config import Config, ConfigError, load_configs, read_config_file
from ..model_io.generate import ModelSpecError, generate_text, load_model
from ..trainer.metrics import plot_metrics

__all__ = ["COMMANDS", "build_parser", "command", "describe_environment", "launch", "main", "torchrun_args"]

#: a command builder receives the `add_subparsers()` object of `shardwise` (argparse gives its type no public name)
AddCommand = Callable[[Any], None]

#: name -> the function that adds the command's parser, with `set_defaults(handler=...)` (`Namespace -> exit code`)
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
#: torchrun options that choose a rendezvous; with none of them on one node, `--standalone` needs no setup
_RENDEZVOUS_DESTS = (
    "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "master_addr", "master_port", "standalone",
)
_UNSET = object()


def _parse_torchrun(args: Sequence[str]) -> argparse.Namespace:
    """Parse ``args`` with torchrun's own parser; rendezvous options left out read as ``_UNSET``."""
    parser = torchrun.get_args_parser()
    parser.prog = "shardwise run"
    # A sentinel default tells "not given" apart from "given the default value".
    parser.set_defaults(**{dest: _UNSET for dest in _RENDEZVOUS_DESTS})
    return parser.parse_args(list(args))


def torchrun_args(args: Sequence[str]) -> list[str]:
    """The argument list for ``torch.distributed.run.main``: ``args`` plus ``--standalone`` when needed.

    ``--standalone`` is added only on a single node (``--nnodes`` 1) with no rendezvous option given, so every
    explicit multi-node setup passes through untouched. Bad arguments exit with torchrun's usage message (status 2).
    """
    parsed = _parse_torchrun(args)
    _, max_nodes = torchrun.parse_min_max_nnodes(parsed.nnodes)
    # a rendezvous picked on the command line or in torchrun's `PET_*` environment
    given = any(getattr(parsed, dest) is not _UNSET or f"PET_{dest.upper()}" in os.environ
                for dest in _RENDEZVOUS_DESTS)
    return list(args) if max_nodes != 1 or given else ["--standalone", *args]


def _exit_code(error: BaseException) -> int:
    """The failed script's exit status, or 1 when it died by a signal or gave none."""
    failures = getattr(error, "failures", {})
    codes = [getattr(f, "exitcode", 1) for f in failures.values()]
    code = next((c for c in codes if c != 0), 1)
    return code if 0 < code < 256 else 1


def _launch_environment(args: Sequence[str], gpus: Optional[int] = None) -> None:
    """Set the workers' environment that torchrun leaves to us (a variable the user set wins): where the ranks run
    (:mod:`shardwise.comm.placement`; ``gpus`` defaults to what torch sees), ``OMP_NUM_THREADS`` (an equal share of
    the cores: torchrun would set 1, with a warning block) and, with ``--max-restarts``,
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a shared store hung 5 of 8 restarts).  Why each, and what was measured:
    docs/trainer.md ("Elastic restarts", "Command line")."""
    parsed = _parse_torchrun(args)
    # ranks torchrun starts on this node; None for `gpu`/`auto`/`xpu`, which it sizes to the devices it finds
    per_node = str(parsed.nproc_per_node)
    nproc = int(per_node) if per_node.isdigit() else os.cpu_count() if per_node == "cpu" else None
    if nproc is not None:
        placement = plan_placement(nproc, visible_gpus() if gpus is None else gpus)
        os.environ.update(placement.env)
        if placement.note:
            print(placement.note, file=sys.stderr, flush=True)
    if "OMP_NUM_THREADS" not in os.environ and nproc is not None and nproc > 1:
        os.environ["OMP_NUM_THREADS"] = str(max(1, _usable_cores() // nproc))
    if int(parsed.max_restarts) > 0:
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


def launch(args: Sequence[str], gpus: Optional[int] = None) -> int:
    """``shardwise run ARGS``: set the workers' environment, run torchrun, return the exit code.

    ``gpus`` stands in for the GPUs torch sees (tests pass it to try a one-GPU machine's plan on a CPU one).
    """
    _launch_environment(args, gpus)
    try:
        torchrun.main(torchrun_args(args))
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
        "to torchrun; `--standalone` is added on one node when no rendezvous option is given. Each rank "
        "takes a GPU when there is one per local rank (NCCL); with fewer GPUs than ranks, the ranks run on "
        "the CPU (gloo) and one line says so. `shardwise run --help` shows torchrun's options.",
        add_help=False,
        # No option prefix: every argument, `--help` included, belongs to torchrun.
        prefix_chars=" ",
    )
    parser.add_argument("args", nargs=argparse.REMAINDER)
    parser.set_defaults(handler=lambda ns: launch(ns.args))


# ------------------------------------------- shardwise generate / env / plot


def _generate(ns: argparse.Namespace) -> int:
    try:
        model = load_model(ns.checkpoint, ns.model_json, trust_source=ns.trust_model_source)
    except (ModelSpecError, FileNotFoundError) as error:
        print(f"shardwise generate: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # a checkpoint problem: CheckpointError, a state_dict mismatch
        print(f"shardwise generate: cannot load {ns.checkpoint}: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    for index in range(ns.samples):
        text = generate_text(model, ns.prompt, ns.tokens, ns.temperature, seed=ns.seed + index)
        print(text if ns.samples == 1 else f"--- sample {index + 1} ---\n{text}", flush=True)
    return 0


@command("generate")
def _add_generate(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="sample text from a trained example model (sharded or consolidated checkpoint)",
        description="Rebuild the byte-level model described by `model.json` (written by examples/train_gpt.py into "
        "its run directory; looked up in CHECKPOINT's directory and its run directory only), load CHECKPOINT's "
        "weights in this process, and print PROMPT continued. A model.json that names a Python file as `source` "
        "is refused unless you pass --trust-model-source (importing the file runs it); one that names an "
        "installed module (`\"module\": \"pkg.mod:Class\"`) needs no flag. CHECKPOINT is a `checkpoint_dir` "
        "(its `latest`), one tag directory, or a `.safetensors`/`.pt` file from `shardwise checkpoint consolidate`. "
        "Exit 0, or 2 with the problem on stderr.",
    )
    parser.add_argument("checkpoint", metavar="CHECKPOINT")
    parser.add_argument("--prompt", default="def ", help="text to continue (default: %(default)r)")
    parser.add_argument("--tokens", type=_positive_int, default=200, help="bytes to generate (default 200)")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 is greedy (default 0.8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    parser.add_argument("--samples", type=_positive_int, default=1, help="how many samples (default 1)")
    parser.add_argument("--model-json", default=None, metavar="PATH", help="the model description, if not found")
    parser.add_argument("--trust-model-source", action="store_true",
                        help="run the Python file model.json names as `source` (it executes with your permissions: "
                        "pass this only for a file you have read or wrote)")
    parser.set_defaults(handler=_generate)


@command("env")
def _add_env(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "env", help="print versions, distributed backends, CPU cores and GPUs",
        description="Print what a bug report needs: Python, shardwise, torch and related versions, "
        "the distributed backends this torch has, usable CPU cores and GPUs.",
    )
    parser.set_defaults(handler=lambda ns: print(describe_environment()) or 0)


_PACKAGES = ("shardwise", "torch", "numpy", "pydantic", "PyYAML", "safetensors", "tqdm", "matplotlib", "tensorboard",
             "transformers")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def describe_environment() -> str:
    """What a bug report needs, as ``name: value`` lines: versions, distributed backends, CPU cores and GPUs."""
    backends = {"gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available, "mpi": dist.is_mpi_available}
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        gpus = f"{len(names)} (CUDA {torch.version.cuda}): " + ", ".join(names)
    else:
        gpus = f"none (CUDA not available; torch built with CUDA {torch.version.cuda or 'none'})"
    rows = [
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("platform", platform.platform()),
        ("packages", ", ".join(f"{p} {_version(p)}" for p in _PACKAGES)),
        ("distributed backends", ", ".join(f"{name} {'yes' if check() else 'no'}" for name, check in backends.items())),
        ("default backend", "nccl" if torch.cuda.is_available() else "gloo"),
        ("CPU cores", f"{_usable_cores()} usable of {os.cpu_count()}; torch threads {torch.get_num_threads()}"),
        ("GPUs", gpus),
    ]
    return "\n".join(f"{name}: {value}" for name, value in rows)


def _plot(ns: argparse.Namespace) -> int:
    out = Path(ns.out) if ns.out else Path(ns.metrics).with_suffix(".png")
    try:
        plot_metrics(ns.metrics, out)
    except (ImportError, ValueError, OSError) as error:
        print(f"shardwise plot: {error}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


@command("plot")
def _add_plot(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plot", help="draw loss and lr curves from a Trainer metrics file",
        description="Read METRICS (the JSON lines `shardwise.Trainer(metrics_file=...)` writes) and draw "
        "train/eval loss and learning rate against step into a PNG. Needs matplotlib "
        "(`pip install 'shardwise[plot]'`). Exit 0, or 2 with the problem on stderr.",
    )
    parser.add_argument("metrics", metavar="METRICS")
    parser.add_argument("-o", "--out", default=None, metavar="PNG", help="output file (default: METRICS with .png)")
    parser.set_defaults(handler=_plot)


# ------------------------------------------------------- shardwise config validate


def _resolved(config: Any, world_size: int) -> dict[str, Any]:
    """``config`` as a dict with its batch sizes resolved for ``world_size`` (``auto`` where still pending)."""
    return config.to_dict() | config.batch_sizes(world_size).as_keys()  # type: ignore[no-any-return]


def _explained(config: Any, name: str | None = None) -> list[str]:
    """The info lines about ``config``: what was ignored or read differently, and how each ``auto`` resolves."""
    where = f"engines.{name}: " if name is not None else ""
    lines = [f"note: {where}{note}" for note in config.notes]
    lines += [f"note: {where}`{path}: auto` resolves at initialize: {how}" for path, how in config.pending.items()]
    return lines


def _in_dialect(config: Any, dialect: str, name: str | None = None) -> tuple[Any, list[str]]:
    """``config`` as ``dialect`` applies it: ``deepspeed`` adds what ``shardwise.deepspeed.initialize`` sets when a
    key is absent (clipping 1.0, ...), with the line it logs; ``shardwise`` is ``shardwise.initialize``'s."""
    if dialect != "deepspeed":
        return config, []
    from ..deepspeed.defaults import apply_defaults  # only this option needs the dialect

    applied, choices = apply_defaults(config, client_optimizer=False)
    where = f"engines.{name}: " if name is not None else ""
    return applied, [f"note: {where}{choice.line()}" for choice in choices]


def _validate(ns: argparse.Namespace) -> int:
    path = Path(ns.file)
    fmt = ns.format or ("json" if path.suffix.lower() == ".json" else "yaml")
    try:
        top = read_config_file(path)  # read once: a 2 MiB file takes a second to parse
        if "engines" in top:
            configs = load_configs(top, name=str(path))
            applied = {name: _in_dialect(c, ns.dialect, name) for name, c in configs.items()}
            data = {"engines": {name: _resolved(c, ns.world_size) for name, (c, _) in applied.items()}}
            notes = [line for name, c in configs.items() for line in _explained(c, name) + applied[name][1]]
        else:
            config, chosen = _in_dialect(Config.load(top, name=str(path)), ns.dialect)
            data, notes = _resolved(config, ns.world_size), _explained(config) + chosen
    except ConfigError as error:
        print(error, file=sys.stderr)
        return 2
    # The config goes to stdout (still a valid file); the notes go to stderr.
    for line in notes:
        print(line, file=sys.stderr)
    header = f"# {path}: valid; batch sizes resolved for world_size {ns.world_size}\n"
    print(json.dumps(data, indent=2) if fmt == "json" else header + yaml.safe_dump(data, sort_keys=False))
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
    validate.add_argument(
        "--dialect", choices=("shardwise", "deepspeed"), default="shardwise",
        help="whose defaults fill the keys the file leaves out: `shardwise.initialize`'s (plain PyTorch's, the "
        "default) or `shardwise.deepspeed.initialize`'s (DeepSpeed's: clipping 1.0, ...)")
    validate.set_defaults(handler=_validate)


# More commands: an `@command(name)` function, or the feature's own builder registered with `command(name)(builder)`.
from ..checkpoint.cli import add_checkpoint_commands  # noqa: E402 - registered with the others

command("checkpoint")(add_checkpoint_commands)


# ------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """The ``shardwise`` parser with every registered command."""
    parser = argparse.ArgumentParser(prog="shardwise", description="shardwise: data-parallel training with ZeRO.")
    parser.add_argument("--version", action="version", version=f"shardwise {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS.values():
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``shardwise`` with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    ns = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    handler: Callable[[argparse.Namespace], int] = ns.handler
    return handler(ns)

