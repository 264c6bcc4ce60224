"""The checkpoint layer's front door, and checkpoints of several engines: one subdirectory per engine, one ``latest``.

:func:`save_checkpoints` and a named engine's ``save_checkpoint`` write the layout of ``docs/checkpoints.md`` ("Several
engines in one checkpoint"); an engine without a name owns ``TAG/`` (``save.py``).  Choosing here keeps the layers
one-way: this module imports save.py and load.py, and neither imports it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import torch.distributed as dist

from ..comm.agreement import Session
from ..comm.distributed import Comm
from ..faults.announce import Announcer
from ..faults.ledger import doing
from .commit import commit, fsync_dir, new_temp, write_atomic, write_json
from .files import CheckpointError, is_real_dir
from .layout import GROUP_FORMAT, GROUP_MANIFEST, LATEST, MANIFEST, read_group, read_latest, temp_dir, validate_tag
from .load import load_checkpoint
from .protocol import Checkpointable
from .save import join_save, save_unnamed, write_engine
from .validate import check_complete

__all__ = ["load_checkpoints", "save_checkpoint", "save_checkpoints"]


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


def _ranks(comm: Comm) -> list[int]:
    if not dist.is_initialized():
        return [0]
    return list(dist.get_process_group_ranks(comm.group if comm.group is not None else dist.group.WORLD))


def save_checkpoints(save_dir: Any, engines: Mapping[str, Checkpointable], tag: Optional[str] = None,
                     client_state: Optional[dict[str, Any]] = None, *, comm: Optional[Comm] = None) -> str:
    """Collectively write the checkpoints of ``engines`` (``{name: engine}``) into ``save_dir/tag/<name>/``
    and commit them together; returns the tag's directory.

    Every rank of the default process group calls it, passing the engines it holds (an engine on a subgroup is passed by
    the ranks of that subgroup). ``tag`` defaults to ``global_step{N}`` of the first engine by name; ``client_state`` is
    stored with every engine.
    """
    if not engines:
        raise CheckpointError("save_checkpoints: no engines given; pass `{name: engine, ...}`")
    names = sorted(validate_tag(name) for name in engines)
    comm = comm if comm is not None else Comm(None)
    first = engines[names[0]]
    with _announced(comm, "save_checkpoints", names, first):
        tag = validate_tag(tag if tag is not None else f"global_step{first.global_steps}")
        root = Path(save_dir).absolute()
        session = join_save(comm, "save_checkpoints", root, tag, first.settings.timeout,
                            "pass the same `tag=` on every rank, or none",
                            engines={name: _ranks(engine.comm) for name, engine in engines.items()})
        members = _agree_on_engines(session)
        temp = temp_dir(root, tag, session.payloads[0]["nonce"])
        session.step("preparing the directory", lambda: new_temp(temp, tag) if session.rank == 0 else None)
        try:
            for name in sorted(members):  # the same order on every rank: engines on shared ranks never cross
                if name in engines:
                    write_engine(engines[name], root, tag, temp / name, client_state)
            session.step("committing", lambda: _commit(root, tag, temp, sorted(members)) if session.rank == 0 else None)
        except BaseException:
            if session.rank == 0:
                shutil.rmtree(temp, ignore_errors=True)
            raise
        return str(root / tag)


@contextlib.contextmanager
def _announced(comm: Comm, operation: str, names: list[str], first: Checkpointable) -> Iterator[None]:
    """Run ``operation`` as a call of its own, announced on ``comm``'s group; inside an engine's own call
    (a named engine's ``save_checkpoint``), as part of that call."""
    if comm.distributed and comm.ledger.scope is not None:
        yield
        return
    owner = "engines " + ", ".join(f"`{name}`" for name in names)
    announcer = Announcer(comm, owner, lambda: (first.global_steps, 0), engine=False)
    with doing(operation, owner), announcer.scope(operation, after_agreement=True):
        yield


def _agree_on_engines(session: Session) -> dict[str, list[int]]:
    """Name -> the ranks that hold it, the same wherever it is named; every such rank names it."""
    members: dict[str, list[int]] = {}
    for rank, payload in enumerate(session.payloads):
        for name, ranks in payload["engines"].items():
            if members.setdefault(name, ranks) != ranks:
                raise CheckpointError(
                    f"rank {session.rank}: engine `{name}` is an engine on ranks {members[name]} for some ranks and "
                    f"on ranks {ranks} for rank {rank}: these are different engines, give them different names"
                )
    for name, ranks in members.items():
        absent = [r for r in ranks if r < len(session.payloads) and name not in session.payloads[r]["engines"]]
        if absent:
            raise CheckpointError(
                f"rank {session.rank}: engine `{name}` runs on ranks {ranks}, but rank(s) {absent} did not pass it "
                "to `save_checkpoints`: every rank passes every engine it holds"
            )
    return members


def _commit(root: Path, tag: str, temp: Path, names: list[str]) -> None:
    """Rank 0: every engine is complete; commit the tag (a new one, or this engine added to an existing one)."""
    for name in names:
        check_complete(temp / name)
    final = root / tag
    if os.path.lexists(final) and is_real_dir(final) and (final / GROUP_MANIFEST).is_file():
        # add these engines to the existing tag, replacing only their subdirectories, then `latest`
        present = read_group(final)
        for name in names:
            target, aside = final / name, final / f".replaced-{name}-{secrets.token_hex(4)}"
            if os.path.lexists(target):
                os.rename(target, aside)
            os.rename(temp / name, target)
            shutil.rmtree(aside, ignore_errors=True)
        write_json(final / GROUP_MANIFEST, _group_manifest(final.name, sorted(set(present) | set(names))))
        fsync_dir(final)
        write_atomic(final.parent / LATEST, final.name.encode())
        shutil.rmtree(temp, ignore_errors=True)
        return
    if os.path.lexists(final) and (final / MANIFEST).is_file() and len(names) == 1:
        raise CheckpointError(
            f"{final} holds the checkpoint of an engine without a name, and engine `{names[0]}` keeps its files under "
            "its name: pass another `tag=`, or save every engine with `shardwise.save_checkpoints`"
        )
    write_json(temp / GROUP_MANIFEST, _group_manifest(tag, names))
    commit(temp, final)


def _group_manifest(tag: str, names: list[str]) -> dict[str, Any]:
    return {"format": GROUP_FORMAT, "version": 1, "tag": tag, "engines": names}


def load_checkpoints(load_dir: Any, engines: Mapping[str, Checkpointable], tag: Optional[str] = None,
                     **options: Any) -> tuple[Optional[str], Optional[dict[str, Any]]]:
    """Collectively restore each engine of ``{name: engine}`` from ``load_dir/tag/<name>/``.

    Returns ``(the tag's directory, the client_state saved with the engines)``, or ``(None, None)`` with a warning when
    ``tag`` is None and ``load_dir`` has no ``latest``.  ``options`` are ``load_checkpoint``'s.
    """
    if not engines:
        raise CheckpointError("load_checkpoints: no engines given; pass `{name: engine, ...}`")
    root = Path(load_dir).absolute()
    if tag is None:
        if not os.path.lexists(root / LATEST):
            warnings.warn(f"load_checkpoints: {root} has no `{LATEST}`; nothing was loaded", stacklevel=2)
            return None, None
        tag = read_latest(root)
    client: Optional[dict[str, Any]] = None
    first = engines[sorted(engines)[0]]
    with _announced(Comm(None), "load_checkpoints", sorted(engines), first):
        for name in sorted(engines):
            _, state = load_checkpoint(engines[name], root, tag, member=name, **options)
            client = state if client is None else client
    return str(root / tag), client

