"""A third process writes into the job's c10d store; the store's host exits after a save (issue 35).

Every wait on the store is bounded by the timeout that governs it, and a value no
rank wrote is an error naming its key, within about a heartbeat interval
(`comms.timeout` 3 s here: an interval of 0.1 s): never a hang in `store.get`, and
never "rank 0 (this very rank) is gone".  Rank 0, which hosts the store under
`env://` rendezvous, exiting right after a committed `save_checkpoint` is the end
of the job, not an error: rank 1's save returns, the checkpoint is complete, and
only a later collective says that rank 0 and its store are gone.

A rank blocked in `store.wait` on the job's store (a user's wait, or torch's) still beats: the heartbeat has a
connection of its own (requests on one TCPStore client run one at a time, so such a wait held every beat and
the rank was judged gone; the GIL is released, measured).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from _faults_common import COMMS_TIMEOUT, bounded_outcome, die, make_engine, outcome, record_row, train_step
from _store_forger import forge, store_prefix

from shardwise.comm.agreement import _ROOT
from shardwise.comm.distributed import group_key
from shardwise.faults.heartbeat import Heartbeat
from shardwise.testing import run_distributed

#: the most a forged value may take to be named: about a heartbeat interval (0.1 s), with room for a loaded machine
NAMED_WITHIN = 1.5
LIMIT = 25.0  # a wait still going after this long is reported as a hang


def _rejoin() -> tuple[int, int]:
    """Leave the harness's file store for a `TCPStore` that rank 0 hosts (`env://`), as torchrun-less jobs do."""
    rank = dist.get_rank()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    return rank, int(os.environ["MASTER_PORT"])


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


def _trained_engine() -> tuple[int, int, Any]:
    """Rejoin through rank 0's store; an engine at stage 0 that took one step (rank, store port, engine)."""
    rank, port = _rejoin()
    engine = make_engine(0)
    train_step(engine, 0)
    return rank, port, engine


def _forged_member_list(root: str) -> dict[str, Any]:
    rank, port, engine = _trained_engine()
    result: dict[str, Any] = {}
    if rank == 0:  # only rank 0 saves; a third process lists rank 1 as having joined
        group = f"{_ROOT}/{group_key(engine.comm.group)}"  # the agreement's keys for this group
        call = _store().add(f"{group}/next/0", 0) + 1
        forge(port, {f"{store_prefix()}{group}/{call}/members": "0,1"})
        result = bounded_outcome(lambda: engine.save_checkpoint(root), LIMIT)
        _store().set("test/done", "1")
        _store().wait(["test/seen"], timedelta(seconds=20))  # rank 1 read "done" before this store goes
    else:
        _store().wait(["test/done"], timedelta(seconds=LIMIT + 20))
        _store().set("test/seen", "1")
    return result


def test_a_forged_member_list_is_named_not_waited_on(tmp_path: Path) -> None:
    saver, _ = run_distributed(_forged_member_list, 2, args=(str(tmp_path),), timeout=90)
    assert saver["error"] == "StoreValueError", saver
    assert "/payload/1`" in saver["message"] and "members" in saver["message"], saver["message"]
    assert saver["seconds"] < NAMED_WITHIN, saver
    record_row("misuse", "a third process lists rank 1 as joined (`members` = \"0,1\") while only rank 0 calls "
               "`save_checkpoint`", "0", "rank 0 raises `StoreValueError` naming the store key that lacks rank 1's "
               "payload (was: waited in `store.get` past `checkpoint.timeout`)", saver["seconds"])


def _malformed_heartbeat(_: Any) -> dict[str, Any]:
    rank, port, engine = _trained_engine()
    if rank == 1:
        _store().set("test/dying", "1")
        die()
    _store().wait(["test/dying"], timedelta(seconds=30))
    time.sleep(0.3)  # rank 1's heartbeat thread is gone with it: nothing overwrites the forged record
    forge(port, {f"{store_prefix()}shardwise/faults/alive/1": "not a heartbeat {"})
    saving = bounded_outcome(lambda: engine.save_checkpoint("/nonexistent/never-written"), LIMIT)
    training = bounded_outcome(lambda: train_step(engine, 1), LIMIT)
    return {"save": saving, "train": training}


def test_a_malformed_heartbeat_record_is_named_within_an_interval() -> None:
    survivor, _ = run_distributed(_malformed_heartbeat, 2, args=(None,), timeout=120, expect_dead=(1,))
    for way, result in survivor.items():
        message = result.get("message", "")
        assert result["error"] == "StoreRecordError", (way, result)
        assert "`shardwise/faults/alive/1`" in message and "'not a heartbeat {'" in message, (way, message)
        assert "rank 0 is gone" not in message, (way, message)
        assert result["seconds"] < NAMED_WITHIN, (way, result)
        record_row("misuse", f"rank 1 killed and its heartbeat record replaced by text that is not JSON, while rank 0 "
                   f"{'saves a checkpoint' if way == 'save' else 'trains'}", "0",
                   "rank 0 raises `StoreRecordError` naming the key and the value (was: blamed itself as the "
                   "unreachable store's host, after 11 s)", result["seconds"])


def _host_exits_after_save(root: str) -> dict[str, Any]:
    rank, _, engine = _trained_engine()
    if rank == 0:
        engine.save_checkpoint(root, tag="last")
        os._exit(0)  # the job's end on rank 0: its store goes with it
    saved = outcome(lambda: engine.save_checkpoint(root, tag="last"))
    later = outcome(lambda: train_step(engine, 1))
    return {"saved": saved, "later": later, "latest": (Path(root) / "latest").read_text()}


def test_the_store_host_exiting_after_a_committed_save_ends_the_job_quietly(tmp_path: Path) -> None:
    for attempt in range(3):  # the race (rank 0 gone before rank 1 read its last outcome) lost 5 of 5 times before
        root = tmp_path / str(attempt)
        _, survivor = run_distributed(_host_exits_after_save, 2, args=(str(root),), timeout=90, expect_dead=(0,))
        assert survivor["saved"]["error"] is None, survivor["saved"]
        assert survivor["latest"] == "last" and (root / "last" / "shardwise.json").is_file()
        later = survivor["later"]
        assert later["error"] == "RankGoneError" and "rank 0 is gone" in later["message"], later
        assert later["seconds"] < COMMS_TIMEOUT, later
    record_row("checkpoint", "rank 0, which hosts the c10d store (`env://`), exits right after a committed "
               "`save_checkpoint`", "0", "rank 1's `save_checkpoint` returns (the checkpoint is complete); its next "
               "collective raises `RankGoneError` naming rank 0 and its store (was: a raw `DistNetworkError`)",
               survivor["later"]["seconds"])


def test_a_rank_waiting_in_store_wait_still_beats() -> None:
    """One process: a TCPStore client (under a prefix, as the default store is) blocked in `wait` for 1.5 s while
    a heartbeat every 0.05 s beats into it (it used to manage one beat, when the wait returned)."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30), wait_for_workers=False)
    store = dist.PrefixStore("default_pg", dist.TCPStore("127.0.0.1", server.port, 1, False, timedelta(seconds=30)))
    beat = Heartbeat(store, 0, 0.05)
    beat.start()
    try:
        before = beat.beats
        start = time.monotonic()
        with pytest.raises(dist.DistStoreError):
            store.wait(["never written"], timedelta(seconds=1.5))
        waited = time.monotonic() - start
        during = beat.beats - before
    finally:
        beat.stop()
    assert during >= 0.5 * waited / 0.05, f"{during} beats in a {waited:.2f} s `store.wait` (one every 0.05 s due)"
