"""DCP's save, with its exchanges carried by the checkpoint's store steps instead of collectives.

``torch.distributed.checkpoint.save`` exchanges plans and write results with
collectives on the training group: a rank that dies or hangs inside it leaves
the others in a collective until the process group's timeout (30 minutes by
default).  Here the same DCP pieces (planner, storage writer) run in the same
order as ``dcp.save`` runs them, but each exchange is a :class:`Session` step:
bounded by ``checkpoint.timeout``, failing within a few heartbeats when a rank
is gone, and raising every rank's error on every rank.

1. every rank makes its local plan; rank 0 gets them all;
2. rank 0 makes the global plan (drops duplicate replicated chunks, names each
   rank's file); every rank takes its own;
3. every rank writes its data (:class:`~.save._RankWriter`: data, fsync,
   ``rankR.json``, their checksums); rank 0 gets every rank's results;
4. in the caller's commit step, :meth:`Written.finish` has rank 0 write the
   ``.metadata`` index from all results, and returns every file's checksum.

A load needs no exchange at all (each rank reads what it asks for), so it runs
``dcp.load`` on each rank alone (``no_dist``) inside a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import WriteResult

from ..comm.agreement import Session
from .digests import digest
from .errors import StoreValueError
from .oserror import explained

__all__ = ["Written", "save_through_steps"]

INDEX = ".metadata"


@dataclass
class Written:
    """What rank 0 needs to finish a save: the global metadata, every rank's results and file checksums."""

    writer: Any
    root: Path
    metadata: Any = None
    results: list[Any] = field(default_factory=list)
    files: dict[str, Any] = field(default_factory=dict)

    def finish(self) -> dict[str, Any]:
        """Write the ``.metadata`` index (rank 0); every file's size and SHA-256."""
        self.writer.finish(metadata=self.metadata, results=self.results)
        return {**self.files, INDEX: digest(self.root / INDEX)}


def save_through_steps(session: Session, state_dict: Any, writer: Any, planner: Any, root: Path) -> Written:
    """Plan and write ``state_dict`` with DCP's ``planner`` and ``writer``; see the module docstring."""
    coordinator = session.rank == 0
    written = Written(writer, root)
    # as `dcp.save` does first: each Stateful object gives its state_dict
    state_dict = {key: value.state_dict() if isinstance(value, Stateful) else value for key, value in state_dict.items()}

    def local_plan() -> Any:
        planner.set_up_planner(state_dict=state_dict, storage_meta=writer.storage_meta(), is_coordinator=coordinator)
        writer.set_up_storage_writer(coordinator, rank=session.rank, use_collectives=True)
        return writer.prepare_local_plan(planner.create_local_plan())

    _, plans = session.step("planning its write", local_plan, objects=SavePlan)

    def global_plan() -> Optional[list[Any]]:
        if not coordinator:
            return None
        plans_out, written.metadata = planner.create_global_plan(plans)
        return list(writer.prepare_global_plan(plans_out))

    _, central = session.step("planning the checkpoint's files", global_plan, objects=Optional[list[SavePlan]])
    mine = _own_plan(central[0], session)

    def write() -> tuple[Any, dict[str, Any]]:
        pending = writer.write_data(planner.finish_plan(mine), planner)
        pending.wait()
        return pending.value(), writer.files

    _, outcomes = session.step("writing its shard", lambda: explained(root, write),
                               objects=tuple[list[WriteResult], dict[str, Any]])
    written.results = [results for results, _ in outcomes]
    for _, files in outcomes:
        written.files.update(files)
    return written


def _own_plan(central: Optional[list[SavePlan]], session: Session) -> SavePlan:
    """This rank's part of rank 0's global plan, which must hold one plan per rank."""
    if central is None or len(central) != session.world_size:
        raise StoreValueError(
            f"rank {session.rank}: rank 0's global save plan holds {'no' if central is None else len(central)} "
            f"plan(s), expected one per rank ({session.world_size}); only shardwise's ranks should write to the "
            "rendezvous store: run every rank with the same shardwise and torch (`shardwise env`)"
        )
    return central[session.rank]
