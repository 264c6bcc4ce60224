"""One master store for every stage (``shardwise.zero.store``; docs/zero.md, docs/offload.md), one process.

Every stage keeps its fp32 masters and optimizer state in a :class:`MasterStore`, its home chosen once at
``initialize``: in memory, the masters the model's own storage where it holds fp32 values in memory, or in
files.  The home in files is one for every stage: at stages 1-3 alike a sub-group holding only a parameter
no rank had a gradient for is neither read nor written (torch would leave it alone; the flat stages used
to read and write it back unchanged), so a step moves 12 bytes (fp32 master and Adam's two moments) per
element that trains, each way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from _parity import ParityNet, train_steps
from torch import nn

import shardwise
from shardwise.zero.store.nvme import Nvme
from shardwise.zero.store.store import MasterStore, Resident

#: (stage, dtype, offload) -> (home, masters are the model's own storage)
HOMES = {
    **{(stage, "fp32", None): (Resident, True) for stage in range(4)},
    **{(stage, "bf16", None): (Resident, False) for stage in range(3)},
    (3, "bf16", None): (Resident, True),  # stage 3 keeps its shards in fp32 and casts them as it sends them
    **{(stage, "fp32", "offload_optimizer"): (Nvme, False) for stage in (1, 2, 3)},
    (3, "fp32", "offload_param"): (Resident, False),  # a view of a shard kept in a file would leave memory with it
}
UNUSED = 8 * 8 + 8  # elements of the parameters no forward reads
#: a sub-group is 8 elements: every piece of the model starts on a sub-group's edge at every stage
SUB_GROUP = 8


class _WithUnused(ParityNet):
    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(8, 8)  # never read by forward: no rank has a gradient for it


def _engine(stage: int, dtype: str, offload: Optional[str], nvme: Path) -> Any:
    torch.manual_seed(0)
    model = _WithUnused()
    zero: dict[str, Any] = {"stage": stage, "sub_group_size": SUB_GROUP}
    if offload is not None:
        zero[offload] = {"device": "nvme", "nvme_path": str(nvme)}
    config = {"zero_optimization": zero, "bf16": {"enabled": dtype == "bf16"}}
    return shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)


@pytest.mark.parametrize("stage,dtype,offload", sorted(HOMES, key=str))
def test_every_stage_keeps_its_masters_in_one_store_whose_home_is_chosen_once(
        stage: int, dtype: str, offload: Optional[str], tmp_path: Path) -> None:
    engine = _engine(stage, dtype, offload, tmp_path)
    store = engine.strategy.store
    home, in_model = HOMES[(stage, dtype, offload)]
    assert type(store) is MasterStore and type(store.home) is home and store.home.in_model == in_model
    trained = [p for p in store.pieces if p.key is not None]
    numel = sum(p.numel() for p in engine.module.parameters())  # (stage 3: the gathered sizes, of the shapes)
    assert sum(p.numel for p in trained) == sum(torch.Size(p.shape).numel() for p in trained) == numel
    assert {id(t) for t in engine.optimizer.inner.param_groups[0]["params"]} == {id(p.key) for p in trained}
    train_steps(engine, 0, 2, rank=0)
    masters = engine.memory_breakdown()["master_weights"]
    assert (masters == 0) == in_model, masters  # nothing held apart where the model's storage is the masters
    engine.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_sub_group_of_a_parameter_no_rank_had_a_gradient_for_moves_no_bytes(stage: int, tmp_path: Path) -> None:
    engine = _engine(stage, "fp32", "offload_optimizer", tmp_path)
    files = engine.strategy.store.home.files
    numel = sum(p.numel() for p in engine.module.parameters())
    before = engine.full_state_dict()["unused.weight"]
    train_steps(engine, 0, 1, rank=0)  # the first step creates Adam's state
    read, written = files.bytes_read, files.bytes_written
    train_steps(engine, 1, 1, rank=0)
    moved = (files.bytes_read - read, files.bytes_written - written)
    assert moved == ((numel - UNUSED) * 12, (numel - UNUSED) * 12), (moved, numel)
    assert torch.equal(engine.full_state_dict()["unused.weight"], before)  # left alone, as torch leaves it
    engine.destroy()
