"""Collectives through shared memory (``shardwise.comm.shm``) against gloo's own, on 2 and 3 ranks.

Both paths: tensors of the process's own, staged through the segment's slots,
and regions of a buffer every rank maps (``Comm.shm.zeros``), read in place.

2 ranks: bit-identical to gloo (one addition per element either way).  3 ranks:
integers exact, floats within 1e-6 of gloo (the order of the additions differs),
and identical on every rank (the sum is taken in rank order everywhere).  Also:
sizes across the chunk boundary, non-contiguous tensors, several collectives in
flight, the fall-back to gloo when one rank cannot map the segment, nothing
left in /dev/shm, and a peer that dies mid-collective named within seconds.
"""

from __future__ import annotations

import gc
import os
import time

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise.comm import shm
from shardwise.comm.distributed import Comm
from shardwise.faults import RankGoneError
from shardwise.testing import distributed_test, run_distributed

_SIZES = (0, 1, 7, shm.CHUNK // 4 + 3, 2 * shm.CHUNK // 4)  # elements: empty, tiny, odd, across chunks
_DTYPES = (torch.float32, torch.bfloat16, torch.int64)


def _open() -> Comm:
    comm = Comm(None, timeout=30)
    comm.open_shared_memory()
    assert comm.shm.active and comm.transport.startswith("shared memory"), comm.transport
    return comm


def _values(n: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * dist.get_rank() + salt)
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, (n,), generator=generator)
    return torch.randn(n, generator=generator).to(dtype)


def _same(got: torch.Tensor, want: torch.Tensor, exact: bool) -> None:
    if exact or not got.is_floating_point():
        assert torch.equal(got, want), (got - want).abs().max()
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def _against_gloo(exact: bool) -> None:
    comm, world = _open(), dist.get_world_size()
    for n in _SIZES:
        for dtype in _DTYPES:
            if dtype == torch.bfloat16 and not exact:
                continue  # 3 ranks: bf16 rounds after each addition, in another order than gloo's
            x = _values(n, dtype, 1)
            _in_place(comm, x, exact)
            got, want = x.clone(), x.clone()
            comm.all_reduce(got)
            dist.all_reduce(want)
            _same(got, want, exact)
            # every rank holds the very same sum (replicas stay identical)
            every = torch.empty(world * n, dtype=dtype)
            dist.all_gather_into_tensor(every, got)
            assert all(torch.equal(part, got) for part in every.view(world, n)) if n else True

            gathered, want_gathered = torch.empty(world * n, dtype=dtype), torch.empty(world * n, dtype=dtype)
            comm.all_gather(gathered, x)
            dist.all_gather_into_tensor(want_gathered, x)
            assert torch.equal(gathered, want_gathered), (n, dtype)

            full = _values(world * n, dtype, 2)
            out, want_out = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
            comm.reduce_scatter(out, full)
            dist.reduce_scatter_tensor(want_out, full.clone())
            _same(out, want_out, exact)


def _in_place(comm: Comm, x: torch.Tensor, exact: bool) -> None:
    """The same collectives over regions of a buffer every rank maps, at an offset, next to other data."""
    world, n = dist.get_world_size(), x.numel()
    buffer = comm.shm.zeros(3 + 2 * world * n, x.dtype, torch.device("cpu"))
    assert comm.shm.segment is not None and (comm.shm.segment._copies(buffer) is not None or not buffer.numel())
    around = _values(buffer.numel(), x.dtype, 3)
    buffer.copy_(around)
    region = buffer[3 : 3 + n]
    region.copy_(x)
    want = x.clone()
    dist.all_reduce(want)
    comm.all_reduce(region)
    _same(region, want, exact)
    scattered = buffer[3 + n : 3 + n + world * n]
    want_out = torch.empty(n, dtype=x.dtype)
    dist.reduce_scatter_tensor(want_out, scattered.clone())
    out = scattered[dist.get_rank() * n : (dist.get_rank() + 1) * n]  # in place, as the flat stages do
    comm.reduce_scatter(out, scattered)
    _same(out, want_out, exact)
    assert torch.equal(buffer[:3], around[:3]), "nothing outside the regions changed"


@distributed_test(world_size=2, timeout=120)
def test_two_ranks_match_gloo_bit_for_bit() -> None:
    _against_gloo(exact=True)


@distributed_test(world_size=3, timeout=180)
def test_three_ranks_match_gloo_and_agree_across_ranks() -> None:
    _against_gloo(exact=False)


@distributed_test(world_size=2, timeout=120)
def test_non_contiguous_and_in_flight_together() -> None:
    comm = _open()
    rank = dist.get_rank()
    # a transposed view is summed in place, as gloo would
    y = (torch.arange(12.0) + 10 * rank).view(3, 4).t()
    want = y.contiguous()
    dist.all_reduce(want)
    comm.all_reduce(y)
    assert torch.equal(y, want)
    # several collectives in flight at once complete in order, each with its own result
    tensors = [torch.full((1000 + i,), float(i + rank)) for i in range(6)]
    works = [comm.all_reduce(t, async_op=True) for t in tensors]
    for work in works:
        work.wait()
    assert all(torch.equal(t, torch.full_like(t, 2.0 * i + 1)) for i, t in enumerate(tensors))
    # the segment's file is gone from /dev/shm once every rank mapped it
    if rank == 0:  # rank 0 made it, named after its process id
        assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"shardwise-{os.getpid()}-")]
    # a segment nobody holds is freed, and its worker thread ends
    assert comm.shm.segment is not None
    worker = comm.shm.segment.worker
    del comm, works, work  # `work` too: each waited collective still names its Comm
    gc.collect()
    worker.join(5.0)
    assert not worker.is_alive()


@distributed_test(world_size=2, timeout=120)
def test_destroying_an_engine_ends_its_worker() -> None:
    model = torch.nn.Linear(4, 4)
    engine = shardwise.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {})
    assert engine.comm.shm.active and engine.comm.shm.segment is not None
    worker = engine.comm.shm.segment.worker
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    engine.destroy()
    worker.join(5.0)
    assert not worker.is_alive() and not engine.comm.shm.active


def _one_rank_cannot_map() -> str:
    if dist.get_rank() == 1:
        shm._DIRECTORY = "/nonexistent-shm"  # as a rank on a host without /dev/shm
    comm = Comm(None, timeout=30)
    comm.open_shared_memory()
    assert not comm.shm.active
    x = torch.ones(10) * (dist.get_rank() + 1)
    comm.all_reduce(x)  # over gloo, on every rank
    assert torch.equal(x, torch.full((10,), 3.0))
    return comm.transport


def test_a_rank_that_cannot_map_keeps_every_rank_on_gloo() -> None:
    transports = run_distributed(_one_rank_cannot_map, 2, timeout=120)
    assert transports[0] == "gloo (another rank could not map the segment)", transports
    assert transports[1] == "gloo (there is no /nonexistent-shm)", transports


def _peer_dies() -> dict[str, object]:
    comm = _open()
    x = torch.ones(100)
    comm.all_reduce(x)
    if dist.get_rank() == 1:
        os._exit(0)  # gone without a word, mid-job
    start = time.monotonic()
    try:
        comm.all_reduce(x)
    except RankGoneError as exc:
        return {"error": "RankGoneError", "gone": exc.gone, "seconds": time.monotonic() - start}
    return {"error": None}


def test_a_peer_that_dies_is_named_within_seconds() -> None:
    """A dead peer never publishes its flag: its stopped heartbeat ends the wait, long before `comms.timeout`."""
    survivor, _ = run_distributed(_peer_dies, 2, timeout=120, expect_dead=(1,))
    assert survivor["error"] == "RankGoneError" and survivor["gone"] == [1], survivor
    assert survivor["seconds"] < 15, survivor  # comms.timeout is 30 s; the heartbeat interval 1 s


@pytest.mark.parametrize("machine", ["aarch64", "ppc64le"])
def test_other_cpus_keep_gloo(monkeypatch: pytest.MonkeyPatch, machine: str) -> None:
    monkeypatch.setattr(shm.platform, "machine", lambda: machine)
    assert "not x86-64" in shm.supported(2)
