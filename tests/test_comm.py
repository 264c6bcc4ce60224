"""The collectives in shardwise.comm.distributed.Comm: results and byte counts, on 2 gloo ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.comm.distributed import GLOO_BROADCAST_GATHER_MIN, Comm
from shardwise.testing import distributed_test, run_subtests


@distributed_test(world_size=2, timeout=120)
def test_all_gather_and_reduce_scatter() -> None:
    comm = Comm()
    rank, world = dist.get_rank(), dist.get_world_size()

    def gather(numel: int, in_place: bool) -> None:
        comm.reset_counters()
        out = torch.full((numel * world,), -1.0)
        source = out.narrow(0, rank * numel, numel) if in_place else torch.empty(numel)
        source.copy_(torch.arange(numel, dtype=torch.float32) + 1000 * rank)
        comm.all_gather(out, source, async_op=True).wait()
        want = torch.cat([torch.arange(numel, dtype=torch.float32) + 1000 * r for r in range(world)])
        assert torch.equal(out, want)
        assert comm.bytes_sent["all_gather"] == 4 * numel * (world - 1)

    def reduce_scatter(numel: int, in_place: bool) -> None:
        full = torch.arange(numel * world, dtype=torch.float32) * (rank + 1)
        out = full.narrow(0, rank * numel, numel) if in_place else torch.empty(numel)
        comm.reduce_scatter(out, full.clone() if not in_place else full)
        want = (torch.arange(numel * world, dtype=torch.float32) * 3).narrow(0, rank * numel, numel)
        assert torch.equal(out, want)

    sizes = [7, GLOO_BROADCAST_GATHER_MIN // world + 5]  # gloo's own all-gather, and the broadcast path
    run_subtests(gather, [{"numel": n, "in_place": i} for n in sizes for i in (False, True)])
    run_subtests(reduce_scatter, [{"numel": n, "in_place": i} for n in sizes for i in (False, True)])
