"""Rank 0 dies while it hosts the c10d store: the survivors name the lost store and its host.

With ``env://`` rendezvous (``init_process_group`` outside torchrun) rank 0's
process serves the ``TCPStore`` that holds every rank's heartbeat.  When rank 0
is killed, no record can be read any more: the survivors used to call rank 0
one that "never wrote a heartbeat".  Now they raise `RankGoneError` naming
rank 0 and the store it hosted, through gloo's sockets and through shared
memory (whose wait no longer runs to `comms.timeout`: the store's silence is
rank 0's).  Under torchrun's agent store no rank is blamed for the store.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from _faults_common import COMMS_TIMEOUT, die, make_engine, outcome, record_row, train_step

from shardwise.faults.liveness import store_host
from shardwise.testing import run_distributed

HOST = 0


def _store_host_dies(shared_memory: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    dist.destroy_process_group()  # the harness's file store has no host: rejoin through one rank 0 serves
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    engine = make_engine(0, comms={"shared_memory": shared_memory})
    train_step(engine, 0)
    if rank == HOST:
        die()
    return outcome(lambda: [train_step(engine, step) for step in range(1, 4)])


@pytest.mark.parametrize("shared_memory", [False, True])
def test_the_lost_store_and_its_host_are_named(shared_memory: bool) -> None:
    _, survivor = run_distributed(_store_host_dies, 2, args=(shared_memory,), timeout=90, expect_dead=(HOST,))
    message = survivor["message"]
    assert survivor["error"] == "RankGoneError" and survivor["gone"] == [HOST], survivor
    assert "rank 0 is gone" in message and "the c10d store at 127.0.0.1:" in message, message
    assert "(hosted by rank 0)" in message and "cannot be reached" in message, message
    assert "never wrote a heartbeat" not in message, message
    assert survivor["seconds"] < COMMS_TIMEOUT, survivor
    transport = "shared memory" if shared_memory else "gloo"
    record_row("death", f"rank 0 killed in `forward` while it hosts the c10d store (`env://` rendezvous; "
               f"collectives through {transport})", "0",
               "rank 1 raises `RankGoneError` naming rank 0 and the store it hosted (no record can be read any more)",
               survivor["seconds"])


def test_no_rank_is_blamed_for_the_agent_store(monkeypatch: pytest.MonkeyPatch) -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=5))
    host = store_host(dist.PrefixStore("shardwise", store))
    assert host is not None and host.rank == 0 and host.address == f"127.0.0.1:{store.port}", host
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    host = store_host(store)
    assert host is not None and host.rank is None and "torchrun's agent" in host.describe(), host
    assert store_host(dist.HashStore()) is None  # no server: no host
