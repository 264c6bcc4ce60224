"""``save_checkpoint``: every rank writes its own shard; visible only once all are on disk.

Steps (join, describe, prepare, write, commit: ``docs/checkpoints.md``, "Atomic commit"), each timeout-bounded, a
failure anywhere raised on every rank.  DCP's planner and writer run as ``dcp.save`` runs them, but each exchange is
a store step, not a collective on the training group, where a rank that died inside DCP would leave the others
waiting 30 minutes.  A failure (a full disk, an unwritable directory) names the directory and the cause; only the
new temporary directory is removed, the previous checkpoint and ``latest`` stay as they were.
"""

from __future__ import annotations

import math
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from .._version import __version__
from ..comm.agreement import Session, join
from ..comm.distributed import Comm
from ..faults.errors import RankGoneError
from ..model_io.export import save_state_dict
from ..optim.param_state import ParamShard
from .codec import Encoder
from .commit import commit, explained, need_space, new_temp, write_json
from .files import CheckpointError, StoreValueError, digest
from .layout import FORMAT, INDEX, LATEST, MANIFEST, VERSION, rank_file, temp_dir, validate_tag
from .protocol import Checkpointable
from .stateful import ModelNames, ModelState, OptimizerState, TensorState, capture_rng, describe_shards, dtype_name
from .storage import SavePlanner, read_metadata

__all__ = ["join_save", "save_unnamed", "write_engine"]

#: the 16-bit weights written next to the shards when the config asks for them
WEIGHTS_16BIT = "pytorch_model.bin"


def save_unnamed(
    engine: Checkpointable, save_dir: Any, tag: Optional[str] = None, client_state: Optional[dict[str, Any]] = None
) -> str:
    """:func:`~.group.save_checkpoint` for an engine without a name (its arguments and return value)."""
    tag = validate_tag(tag if tag is not None else f"global_step{engine.global_steps}")
    root = Path(save_dir).absolute()
    write_engine(engine, root, tag, None, client_state)
    return str(root / tag)


def write_engine(engine: Checkpointable, root: Path, tag: str, temp: Optional[Path],
                 client_state: Optional[dict[str, Any]]) -> None:
    """Collectively write ``engine``'s checkpoint of ``tag`` into the new directory ``temp``, which a checkpoint
    of several engines commits with the others; ``temp=None``: into a new one, committed as ``root/tag``."""
    session = join_save(engine.comm, "save_checkpoint", root, tag, engine.settings.timeout,
                        "pass the same `tag=` on every rank, or none (`global_step{N}`)")
    commit_to = root / tag if temp is None else None
    temp = temp if temp is not None else temp_dir(root, tag, session.payloads[0]["nonce"])
    with engine.shards(loading=False) as shards:  # frozen parameters' kept masters and optimizer state travel too
        _Save(engine, shards, session, tag, temp, client_state, commit_to).run()


def join_save(comm: Comm, op: str, root: Path, tag: str, timeout: float, tag_fix: str, **extra: Any) -> Session:
    """Join the ranks of ``comm`` in save ``op`` of ``tag`` into ``root``: the same call, tag and directory."""
    payload = {"op": op, "tag": tag, "dir": str(root), "nonce": secrets.token_hex(6), **extra}
    session = join(comm, op, payload, timeout)
    session.require_same("op", "checkpoint operations", f"call `{op}` on every rank at the same point")
    session.require_same("tag", "tags", tag_fix)
    session.require_same("dir", "directories", "pass the same `save_dir`, on a file system every rank can see")
    return session


class _Save:
    """One save, step by step; see the module docstring."""

    def __init__(self, engine: Checkpointable, shards: list[ParamShard], session: Session, tag: str, temp: Path,
                 client_state: Any, commit_to: Optional[Path]) -> None:
        self.engine, self.shards, self.session, self.tag, self.temp = engine, shards, session, tag, temp
        self.commit_to = commit_to  # where the finished directory is renamed (and `latest` pointed); None: the caller
        self.client_state = client_state if client_state is not None else {}
        self.rank = engine.comm.rank
        self.extra = Encoder("extra", engine.settings.allow_pickle)
        self.encoded: dict[str, Any] = {}
        self.rank_info: dict[str, Any] = {}

    def run(self) -> None:
        _, descriptions = self.session.step("describing its parameters", self._describe, share=True)
        with_master = {name for d in descriptions for name in d["params"]}
        names = ModelNames.of(self.engine.module)
        # Collective where entries are partitioned, with every rank known to be here.
        entries = self.engine.save_entries(names.live(names.others(with_master)))
        weights_16bit = self.engine.weights_16bit()  # collective when asked for
        try:
            states, _ = self.session.step(
                "preparing the checkpoint", lambda: explained(self.temp, lambda: self._prepare(entries)))
            writer = _RankWriter(self.temp, self.temp / rank_file(self.rank), self.rank_info)
            written = _dcp_write(self.session, {k: s.state_dict() for k, s in states.items()}, writer)
            self._commit(lambda: self._finish(descriptions, writer, *written, weights_16bit) if self.rank == 0
                         else None)
        except BaseException:
            if self.rank == 0:  # every rank is past the failed step: nobody writes there any more
                shutil.rmtree(self.temp, ignore_errors=True)
            raise

    def _commit(self, finish: Any) -> None:
        """The last step: rank 0 commits.  When rank 0 then ends the job and takes the store it hosts with it
        before this rank read its outcome, the checkpoint on disk says whether the save completed."""
        try:
            self.session.step("committing", lambda: explained(self.temp, finish))
        except RankGoneError:
            if self.rank == 0 or self.commit_to is None or not _committed(self.temp, self.commit_to, self.rank):
                raise
            warnings.warn(
                f"rank {self.rank}: rank 0 committed {self.commit_to} and then left the job, taking the c10d store "
                "it hosts with it: this save is complete, and the job cannot go on (this rank should exit too)",
                stacklevel=6,
            )

    def _describe(self) -> dict[str, Any]:
        if self.rank == 0:
            explained(self.temp, lambda: new_temp(self.temp, self.tag if self.commit_to is not None else None))
        return describe_shards(self.shards)

    def _prepare(self, entries: dict[str, torch.Tensor]) -> dict[str, TensorState]:
        states: dict[str, TensorState] = {"model": ModelState.saving(self.shards, entries)}
        if self.engine.optimizer is not None:
            states["optim"] = OptimizerState.saving(self.shards)
        config = self.engine.settings
        rng = Encoder(f"rng/{self.rank}", config.allow_pickle)
        self.rank_info = {"rank": self.rank, "world_size": self.engine.comm.world_size}
        if config.save_rng_state:
            self.rank_info["rng"] = rng.encode(capture_rng(), "RNG state")
        states["rng"] = TensorState(dict(rng.tensors))
        if self.rank == 0:
            encode, optimizer, extras = self.extra.encode, self.engine.optimizer, self.engine.extras()
            scheduler = extras.get("scheduler")
            groups = ([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
                      if optimizer else None)
            self.encoded = {
                "client_state": encode(self.client_state, "client_state"),
                "scheduler": None if scheduler is None else encode(scheduler.state_dict(), "lr_scheduler.state_dict()"),
                "precision": encode(extras["precision"].state_dict(), "precision.state_dict()"),
                "counters": extras["counters"].state_dict(),
                "param_groups": encode(groups, "optimizer param_groups") if groups is not None else None,
            }
        states["extra"] = TensorState(dict(self.extra.tensors))
        return states

    def _finish(self, descriptions: list[dict[str, Any]], writer: _RankWriter, metadata: Any, results: list[Any],
                files: dict[str, Any], weights_16bit: Optional[dict[str, torch.Tensor]]) -> None:
        writer.finish(metadata=metadata, results=results)  # the `.metadata` index, from every rank's results
        files = {**files, INDEX: digest(self.temp / INDEX)}
        expected = [rank_file(r) for r in range(self.engine.comm.world_size)] + [MANIFEST, INDEX]
        if weights_16bit is not None:
            save_state_dict(weights_16bit, self.temp / WEIGHTS_16BIT)
            files[WEIGHTS_16BIT] = digest(self.temp / WEIGHTS_16BIT)
            expected.append(WEIGHTS_16BIT)
        write_json(self.temp / MANIFEST, {**self._manifest(descriptions), "files": files})
        absent = [name for name in expected if not (self.temp / name).is_file()]
        absent += sorted({info.relative_path for info in read_metadata(self.temp).storage_data.values()
                          if not (self.temp / info.relative_path).is_file()})
        if absent:
            raise CheckpointError(
                f"rank 0 cannot see {absent} in {self.temp} although every rank reported them written: "
                "`save_dir` must be one directory shared by all ranks (a shared file system), not a local path"
            )
        if self.commit_to is not None:
            commit(self.temp, self.commit_to)

    def _manifest(self, descriptions: list[dict[str, Any]]) -> dict[str, Any]:
        engine = self.engine
        params: dict[str, Any] = {}
        state: dict[str, Any] = {}
        for described in descriptions:
            params.update(described["params"])
            for name, entries in described["state"].items():
                state.setdefault(name, {}).update(entries)
        names = ModelNames.of(engine.module)
        position = {k: i for i, k in enumerate(names.keys)}
        params = {k: params[k] for k in sorted(params, key=lambda name: (position.get(name, len(position)), name))}
        module = {
            n: {"shape": list(t.shape), "dtype": dtype_name(t.dtype)} for n, t in names.tensors.items() if n not in params
        }
        encoded, optimizer = self.encoded, None
        if engine.optimizer is not None:
            optimizer = {"class": engine.optimizer.class_name, "param_groups": encoded["param_groups"], "state": state}
        return {  # the fields validate.py's `_Manifest` checks
            "format": FORMAT, "version": VERSION, "tag": self.tag, "world_size": engine.comm.world_size,
            "stage": engine.stage, "dtype": dtype_name(engine.dtype), "counters": encoded["counters"],
            "state_dict_keys": names.keys, "aliases": names.aliases, "params": params, "module": module,
            "optimizer": optimizer, "scheduler": encoded["scheduler"], "precision": encoded["precision"],
            "client_state": encoded["client_state"], "rng": engine.settings.save_rng_state,
            "versions": {"shardwise": __version__, "torch": torch.__version__},
        }


def _dcp_write(session: Session, state_dict: dict[str, Any], writer: _RankWriter) -> tuple[Any, list[Any], dict]:
    """Step 4 of the module docstring: rank 0's global metadata (None elsewhere), every rank's write results
    and the checksums of every rank's files."""
    coordinator, planner = session.rank == 0, SavePlanner()
    metadata = None

    def local_plan() -> Any:
        planner.set_up_planner(state_dict=state_dict, storage_meta=writer.storage_meta(), is_coordinator=coordinator)
        writer.set_up_storage_writer(coordinator, rank=session.rank, use_collectives=True)
        return writer.prepare_local_plan(planner.create_local_plan())

    _, plans = session.step("planning its write", local_plan, objects=SavePlan)

    def global_plan() -> Optional[list[Any]]:
        nonlocal metadata
        if not coordinator:
            return None
        plans_out, metadata = planner.create_global_plan(plans)
        return list(writer.prepare_global_plan(plans_out))

    _, central = session.step("planning the checkpoint's files", global_plan, objects=Optional[list[SavePlan]])
    if central[0] is None or len(central[0]) != session.world_size:  # one plan per rank
        raise StoreValueError(
            f"rank {session.rank}: rank 0's global save plan holds {'no' if central[0] is None else len(central[0])} "
            f"plan(s), expected one per rank ({session.world_size}); only shardwise's ranks should write to the "
            "rendezvous store: run every rank with the same shardwise and torch (`shardwise env`)"
        )
    mine = central[0][session.rank]

    def write() -> tuple[Any, dict[str, Any]]:
        pending = writer.write_data(planner.finish_plan(mine), planner)
        pending.wait()
        return pending.value(), writer.files

    _, outcomes = session.step("writing its shard", lambda: explained(writer.root, write),
                               objects=tuple[list[WriteResult], dict[str, Any]])
    return metadata, [results for results, _ in outcomes], {k: v for _, files in outcomes for k, v in files.items()}


class _RankWriter(FileSystemWriter):
    """DCP's file writer (one fsynced file per rank) that then writes ``rankR.json``, this rank's "done" marker,
    and keeps the size and SHA-256 of both in ``files``."""

    def __init__(self, path: Path, marker: Path, info: dict[str, Any]) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)
        self.root, self.marker, self.info = path, marker, info
        self.files: dict[str, Any] = {}

    def write_data(self, plan: Any, planner: Any) -> Any:
        # a full disk said up front, not as torch.save's "unexpected pos" (the records add a little to the tensors)
        data = [item.tensor_data for item in plan.items if item.tensor_data is not None]
        need_space(self.root, sum(math.prod(d.chunk.sizes) * d.properties.dtype.itemsize for d in data))
        written = super().write_data(plan, planner)
        written.wait()
        write_json(self.marker, self.info)
        names = {result.storage_data.relative_path for result in written.value()} | {self.marker.name}
        self.files = {name: digest(self.root / name) for name in sorted(names)}
        return written


def _committed(temp: Path, final: Path, rank: int) -> bool:
    """Rank 0 renamed this save's directory into place and pointed ``latest`` at it."""
    try:
        latest = (final.parent / LATEST).read_text().strip()
    except OSError:
        return False
    return not temp.exists() and latest == final.name and all((final / n).is_file() for n in (MANIFEST, rank_file(rank)))
