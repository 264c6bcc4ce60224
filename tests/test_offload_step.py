"""The sub-group step of the store's home in files, every stage's (zero/store/subgroups.py), in one process.

Three pieces in two param groups are stepped sub-group by sub-group out of files by torch's Adam and
compared with Adam stepping the three whole tensors: equal to the bit (tolerance 0: Adam is element-wise,
each chunk is its own tensor with its own `step`).  A piece the arrangement passes by is left alone as
torch leaves a parameter without a gradient, and a sub-group holding only such pieces is neither read nor
written.  `processes.running` tells a live process from one that exited.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import torch

from shardwise.comm.processes import running
from shardwise.zero.flat.layout import Piece
from shardwise.zero.offload.files import NvmeFiles
from shardwise.zero.store.plan import Chunk, plan_sub_groups
from shardwise.zero.store.subgroups import OffloadSlot, SubGroupStepper, placeholder, pool_for

#: piece sizes: the first spans sub-groups 1 and 2 and starts the third, which the other two share
SIZES = (700, 50, 400)
SUB_GROUP = 300
STATE_BYTES = 8  # Adam: exp_avg and exp_avg_sq, fp32


class _Pieces:
    """A stand-in arrangement: the tensors the inner optimizer holds, and what the step published."""

    def __init__(self) -> None:
        self.keys = [placeholder(n) for n in SIZES]
        self.passed_by: set[int] = set()
        self.published = [torch.full((n,), float("nan")) for n in SIZES]

    def stepped(self, chunk: Chunk) -> Optional[torch.Tensor]:
        return None if chunk.piece in self.passed_by else self.keys[chunk.piece]

    def publish_sub_group(self, updated: list[tuple[Chunk, torch.Tensor]]) -> None:
        for chunk, master in updated:
            self.published[chunk.piece].narrow(0, chunk.at, chunk.numel).copy_(master)


def _groups(params: list[torch.Tensor]) -> list[dict[str, object]]:
    return [{"params": params[:2], "lr": 1e-2}, {"params": params[2:], "lr": 3e-3, "weight_decay": 0.1}]


def _setup(root: Path) -> tuple[SubGroupStepper, NvmeFiles, list[Piece], list[torch.Tensor]]:
    runs, at = [], 0
    for index, numel in enumerate(SIZES):
        runs.append(Piece(index, 0, numel, at))
        at += numel
    chunks, groups = plan_sub_groups(runs, SUB_GROUP)
    files = NvmeFiles(str(root), 0)
    files.create("master", at * 4)
    initial = [torch.randn(n, generator=torch.Generator().manual_seed(i)) for i, n in enumerate(SIZES)]
    for run, values in zip(runs, initial):
        files.write_from("master", values, run.shard_offset * 4)
    stepper = SubGroupStepper(chunks, groups, pool_for(groups, 3, STATE_BYTES), lambda: files, {}, at)
    return stepper, files, runs, initial


def test_sub_groups_step_as_whole_tensors_and_passed_by_ones_cost_no_io(tmp_path: Path) -> None:
    stepper, files, runs, initial = _setup(tmp_path)
    assert len(stepper.groups) == 4 and stepper.groups[2].chunks == [2, 3, 4], stepper.groups
    pieces = _Pieces()
    inner = torch.optim.Adam(_groups(pieces.keys))
    reference = [v.clone() for v in initial]
    torch_adam = torch.optim.Adam(_groups(reference))
    for step in range(4):
        pieces.passed_by = {0} if step == 2 else set()  # sub-groups 1 and 2 hold piece 0 only
        grads = [torch.randn(n, generator=torch.Generator().manual_seed(100 * step + i)) for i, n in enumerate(SIZES)]
        for index, (key, param) in enumerate(zip(pieces.keys, reference)):
            key.grad = grads[index]
            param.grad = None if index in pieces.passed_by else grads[index].clone()
        read, written = files.bytes_read, files.bytes_written
        stepper.step(inner, pieces)
        torch_adam.step()
        stepped = [g for g in stepper.groups if step != 2 or g.index >= 2]
        state = 0 if step == 0 else STATE_BYTES  # the first step reads masters only, then writes the new state
        assert files.bytes_read - read == sum(g.numel for g in stepped) * (4 + state), step
        assert files.bytes_written - written == sum(g.numel for g in stepped) * (4 + STATE_BYTES), step
        for index in range(len(SIZES)):
            if index not in pieces.passed_by:
                assert torch.equal(pieces.published[index], reference[index]), (step, index)
    assert not inner.state, "the inner optimizer keeps no state between steps"
    assert all(k.stride() == (0,) for k in pieces.keys), "placeholders hold no memory between steps"
    for index, run in enumerate(runs):
        slot = OffloadSlot(stepper, index, run.numel,
                           lambda kind, run=run: files.mapped_range(kind, run.shard_offset, run.numel, torch.float32))
        got, want = slot.get(), torch_adam.state[reference[index]]
        assert sorted(got) == ["exp_avg", "exp_avg_sq", "step"], sorted(got)
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[kind], want[kind]), (index, kind)
        assert torch.equal(got["step"], want["step"]), (index, got["step"], want["step"])
    files.remove()


def test_running_tells_a_live_process_from_one_that_exited() -> None:
    assert running(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid names no process now (reuse this soon is not expected)
    assert not running(child.pid), child.pid
