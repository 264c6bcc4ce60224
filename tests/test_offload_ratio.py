"""A partial NVMe offload (``offload_optimizer.ratio`` below 1; zero/store/plan.py, zero/store/subgroups.py).

Of the ``n`` sub-groups of a rank's shard the first ``int((1 - ratio) * n)`` keep their fp32 master and
optimizer state in host memory, the split moved back to a piece's start where it would cut one; the files
hold the rest only.  In one process: the split, and resident sub-groups stepped in memory with no I/O while
the others move their bytes, equal to torch's Adam to the bit.  On 2 ranks: stages 1, 2 and 3 at ratio 0.5 and
0.2 train to the weights of the same stage without offload (10 steps, accumulation, clipping; atol 1e-6), a
stage-3 piece on each side of the split freezes and thaws as without offload, the files are sized for the
offloaded elements only, ``memory_breakdown`` counts the resident state, a ratio-0.5 checkpoint loads into
ratio 1.0 and into no offload (and back), and the bytes moved per step are theory's for the offloaded share.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from _parity import assert_close_params, full_params, make_model, train_steps

import shardwise
from benchmarks.offload import measure
from shardwise.config import Config, ConfigError
from shardwise.testing import distributed_test, run_distributed, run_subtests
from shardwise.zero.flat.layout import Piece
from shardwise.zero.offload.files import NvmeFiles
from shardwise.zero.store.plan import Chunk, plan_sub_groups, resident_split
from shardwise.zero.store.subgroups import OffloadSlot, SubGroupStepper, placeholder, pool_for

SIZES = (700, 50, 400)
SUB_GROUP = 300
ATOL = 1e-6


def _runs(sizes: tuple[int, ...]) -> list[Piece]:
    runs, at = [], 0
    for index, numel in enumerate(sizes):
        runs.append(Piece(index, 0, numel, at))
        at += numel
    return runs


def test_the_split_keeps_the_first_sub_groups_and_never_cuts_a_piece() -> None:
    even = _runs((300, 300, 300, 300))
    assert [resident_split(even, 300, r) for r in (1.0, 0.5, 0.3, 0.9, 0.01)] == [0, 600, 600, 0, 900]
    # 4 sub-groups; 0.25 keeps 3, whose end (900) cuts piece 2 (750-1150): the split moves back to 750
    runs = _runs(SIZES)
    assert resident_split(runs, SUB_GROUP, 0.25) == 750
    assert resident_split(runs, SUB_GROUP, 0.5) == 0  # the end of sub-group 2 (600) cuts piece 0: none stays
    _, groups = plan_sub_groups(runs, SUB_GROUP, 750)
    assert [(g.start, g.end) for g in groups] == [(0, 300), (300, 600), (600, 750), (750, 1050), (1050, 1150)]


class _Pieces:
    def __init__(self) -> None:
        self.keys = [placeholder(n) for n in SIZES]
        self.published = [torch.full((n,), float("nan")) for n in SIZES]

    def stepped(self, chunk: Chunk) -> Optional[torch.Tensor]:
        return self.keys[chunk.piece]

    def publish_sub_group(self, updated: list[tuple[Chunk, torch.Tensor]]) -> None:
        for chunk, master in updated:
            self.published[chunk.piece].narrow(0, chunk.at, chunk.numel).copy_(master)


def test_resident_sub_groups_step_in_memory_and_move_no_bytes(tmp_path: Path) -> None:
    runs, resident, total = _runs(SIZES), 750, sum(SIZES)
    chunks, groups = plan_sub_groups(runs, SUB_GROUP, resident)
    files = NvmeFiles(str(tmp_path), 0)
    files.create("master", (total - resident) * 4)
    stepper = SubGroupStepper(chunks, groups, pool_for(groups, 2, 8, resident=resident), lambda: files, {}, total,
                              resident)
    initial = [torch.randn(n, generator=torch.Generator().manual_seed(i)) for i, n in enumerate(SIZES)]
    for run, values in zip(runs, initial):
        stepper.write("master", run.shard_offset, values)
    pieces, reference = _Pieces(), [v.clone() for v in initial]
    inner, torch_adam = torch.optim.Adam(pieces.keys, lr=1e-2), torch.optim.Adam(reference, lr=1e-2)
    offloaded = total - resident
    for step in range(3):
        for index, (key, param) in enumerate(zip(pieces.keys, reference)):
            key.grad = torch.randn(SIZES[index], generator=torch.Generator().manual_seed(10 * step + index))
            param.grad = key.grad.clone()
        read, written = files.bytes_read, files.bytes_written
        stepper.step(inner, pieces)
        torch_adam.step()
        assert files.bytes_read - read == offloaded * (4 if step == 0 else 12), step
        assert files.bytes_written - written == offloaded * 12, step
        assert all(torch.equal(p, r) for p, r in zip(pieces.published, reference)), step
    assert {kind: os.path.getsize(files.path(kind)) for kind in ("master", "exp_avg", "exp_avg_sq")} == dict.fromkeys(
        ("master", "exp_avg", "exp_avg_sq"), offloaded * 4), "the files hold the offloaded elements only"
    assert stepper.memory_bytes(master=True) == resident * 4 and stepper.memory_bytes(master=False) == resident * 8
    for index, run in enumerate(runs):
        region = lambda kind, run=run: stepper.region(kind, run.shard_offset, run.numel, torch.float32)  # noqa: E731
        state = OffloadSlot(stepper, index, run.numel, region).get()
        want = torch_adam.state[reference[index]]
        assert torch.equal(state["exp_avg_sq"], want["exp_avg_sq"]) and torch.equal(region("master"), reference[index])
    assert torch.equal(stepper.whole("master", torch.float32), torch.cat(reference))
    files.remove()


# ---------------------------------------------------------------- 2 ranks
def _config(stage: int, nvme: Optional[str], ratio: float = 1.0, micro: int = 2) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 500}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=500, stage3_prefetch_bucket_size=500)
    if nvme is not None:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": 2, "ratio": ratio}
        zero["sub_group_size"] = SUB_GROUP
    return {"zero_optimization": zero, "gradient_accumulation_steps": micro, "gradient_clipping": 0.5,
            "checkpoint": {"timeout": 30}}


def _engine(stage: int, nvme: Optional[str], ratio: float = 1.0, micro: int = 2, model: Any = None) -> Any:
    model = make_model() if model is None else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return shardwise.initialize(model, optimizer, _config(stage, nvme, ratio, micro))


def _holder(engine: Any) -> Any:
    return engine.strategy.store.home  # the store's home in files, at every stage


def _parity_case(stage: int, nvme: str, ratio: float) -> None:
    plain = _engine(stage, None)
    train_steps(plain, 0, 10)
    partial = _engine(stage, nvme, ratio)
    holder = _holder(partial)
    stepper = holder.stepper
    resident, numel = stepper.resident, stepper.numel
    assert 0 < resident < numel, (resident, numel)
    assert (resident > numel // 2) == (ratio < 0.5), (ratio, resident, numel)  # 0.2: 3 of 4 sub-groups stay
    folder = holder.files.folder
    train_steps(partial, 0, 10)
    assert_close_params(full_params(partial), full_params(plain), atol=ATOL)
    assert not partial.optimizer.inner.state, "no state in the inner optimizer between steps, resident or not"
    sizes = {kind: os.path.getsize(holder.files.path(kind)) for kind in ("master", "exp_avg", "exp_avg_sq")}
    assert sizes == dict.fromkeys(sizes, (numel - resident) * 4), (sizes, numel, resident)
    breakdown = partial.memory_breakdown()
    assert breakdown["master_weights"] == holder.pool.nbytes() + resident * 4, breakdown
    assert breakdown["optimizer_state"] == resident * 8, breakdown
    partial.destroy()
    plain.destroy()
    assert not folder.exists()


@distributed_test(world_size=2, timeout=240)
def test_a_partial_offload_trains_as_the_same_stage_without_it(tmp_path: Path) -> None:
    run_subtests(_parity_case, [{"stage": stage, "nvme": str(tmp_path), "ratio": ratio}
                                for stage in (1, 2, 3) for ratio in (0.5, 0.2)])
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


def _freeze_and_thaw(stage: int, nvme: Optional[str]) -> dict[str, torch.Tensor]:
    """embed.weight (resident at ratio 0.5) and fc2.weight (offloaded) stop training at step 2, train again at 4."""
    engine = _engine(stage, nvme, 0.5, micro=1)
    if nvme is not None and stage == 3:
        store = engine.strategy.store
        sides = {p.name: p.at < store.home.resident for p in store.pieces if p.name in ("embed.weight", "fc2.weight")}
        assert sides == {"embed.weight": True, "fc2.weight": False}, sides
    for step in range(6):
        if step in (2, 4):
            for param in (engine.module.embed.weight, engine.module.fc2.weight):
                param.requires_grad_(step == 4)
        train_steps(engine, step, 1)
    params = full_params(engine)
    engine.destroy()
    return params


def _round_trip(stage: int, root: str) -> None:
    """ratio 0.5 -> ratio 1.0 and -> no offload; no offload -> ratio 0.5."""
    nvme = str(Path(root) / "nvme")
    partial = _engine(stage, nvme, 0.5)
    train_steps(partial, 0, 3)
    partial.save_checkpoint(str(Path(root) / "partial"), tag="a")
    whole, plain = _engine(stage, nvme, 1.0), _engine(stage, None)
    for engine in (whole, plain):
        engine.load_checkpoint(str(Path(root) / "partial"), tag="a")
        assert_close_params(full_params(engine), full_params(partial), atol=0.0)
    for engine in (partial, whole, plain):
        train_steps(engine, 3, 3)
    for engine in (whole, plain):  # masters and Adam state carried over exactly, resident or not
        assert_close_params(full_params(engine), full_params(partial), atol=ATOL)
    plain.save_checkpoint(str(Path(root) / "plain"), tag="b")
    back = _engine(stage, nvme, 0.5)
    back.load_checkpoint(str(Path(root) / "plain"), tag="b")
    for engine in (back, plain):
        train_steps(engine, 6, 2)
    assert_close_params(full_params(back), full_params(plain), atol=ATOL)
    for engine in (partial, whole, plain, back):
        engine.destroy()
    dist.barrier()
    assert os.listdir(nvme) == [], os.listdir(nvme)


@distributed_test(world_size=2, timeout=240)
def test_partial_offload_checkpoints_and_trainability(tmp_path: Path) -> None:
    run_subtests(_round_trip, [{"stage": stage, "root": str(tmp_path / f"s{stage}")} for stage in (2, 3)])
    for stage in (2, 3):
        got = _freeze_and_thaw(stage, str(tmp_path / f"freeze{stage}"))
        assert_close_params(got, _freeze_and_thaw(stage, None), atol=ATOL)


def _moved_per_step(nvme: str) -> dict[str, Any]:
    return {f"stage {stage} ratio {ratio}": measure(2, 2, nvme, 262_144, 4, stage=stage, ratio=ratio)
            for stage in (2, 3) for ratio in (0.5, 1.0)}


def test_bytes_moved_per_step_are_the_offloaded_shares(tmp_path: Path) -> None:
    """12 bytes an element read and written once a step, for the elements after the split only."""
    for rank in run_distributed(_moved_per_step, 2, args=(str(tmp_path),), timeout=180):
        for what, figures in rank.items():
            moved = (figures["read_per_step"], figures["written_per_step"])
            assert moved == figures["theory"], (what, moved, figures["theory"])
            resident = figures["resident"]
            assert (0 < resident < figures["shard"]) if "0.5" in what else resident == 0, (what, resident)
            assert figures["state_bytes"] == resident * 8, (what, figures)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("ratio", [0, -0.5, 1.5])
def test_a_ratio_outside_zero_to_one_names_the_value_and_the_fix(ratio: float) -> None:
    section = {"device": "nvme", "nvme_path": "/tmp/x", "ratio": ratio}
    with pytest.raises(ConfigError) as info:
        Config.load({"zero_optimization": {"stage": 2, "offload_optimizer": section}})
    (line,) = info.value.problems
    assert line.startswith(f"`zero_optimization.offload_optimizer.ratio`: got {ratio}; "), line
    assert "above 0 and at most 1" in line and "remove the key" in line, line
    kept = Config.load({"zero_optimization": {"stage": 2, "offload_optimizer": {**section, "ratio": 0.5}}})
    assert kept.zero_optimization.offload_optimizer is not None
    assert kept.zero_optimization.offload_optimizer.ratio == 0.5
