"""Stage 3 shards kept in a file (`offload_param: nvme`) when reads fail, and what host memory they hold.

In one process (the bugs are local to a rank): a shard read that fails half-way (EIO from `os.preadv`,
after half the bytes arrived) or is interrupted leaves no host copy, so the next use reads the file again,
the unit stays sharded and a re-run forward computes with the right weights; a failed read ahead is raised
once, naming the unit, and not again (nor at all by a step writing into that shard); a unit left
gathering with no all-gather refuses to finish the gather.  With `max_in_cpu: 0`, no shard stays in host memory after `full_state_dict`, a step (the
persistent unit's refresh), a thaw or `zero.load_state_dict`, nor a read ahead of a unit a pass did not
use; a thawed piece's master is a copy, not a view of the shard's host copy; `destroy` writes nothing
back into the file it deletes, and holds one shard at a time while it restores the parameters.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
from _parity import batch, make_model
from torch import nn

import shardwise
from shardwise.zero.offload.files import NvmeFiles, OffloadIOError
from shardwise.zero.offload.shards import NvmeShard
from shardwise.zero.stage3.params import Unit, UnitError, UnitState


def _engine(nvme: Path, model: Optional[nn.Module] = None, max_in_cpu: int = 0) -> Any:
    # fc1 and head form the persistent unit (always gathered); embed and fc2 are gathered on use
    model = model if model is not None else make_model()
    zero = {"stage": 3, "stage3_param_persistence_threshold": 500, "stage3_prefetch_bucket_size": 500,
            "offload_param": {"device": "nvme", "nvme_path": str(nvme), "buffer_count": 2,
                              "max_in_cpu": max_in_cpu}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return shardwise.initialize(model, optimizer, {"zero_optimization": zero})


def _train(engine: Any, first: int, steps: int) -> None:
    for step in range(first, first + steps):
        engine.backward(engine(*batch(step, 0)))
        engine.step()


def _unit(engine: Any, name: str) -> Unit:
    unit: Unit = next(u for u in engine.strategy.units if name in u.names)
    return unit


def _in_file(engine: Any, unit: Unit) -> torch.Tensor:
    stored = unit.storage
    values = torch.empty(stored.shape, dtype=stored.dtype)  # type: ignore[attr-defined]
    engine.strategy.shards.files.read_into("params", values, stored.offset)  # type: ignore[attr-defined]
    return values


@contextlib.contextmanager
def _failing_reads(fill: Callable[[memoryview], None], when: Callable[[], bool] = lambda: True,
                   times: int = 1) -> Iterator[list[int]]:
    """The next ``times`` reads of the shards' file for which ``when()`` holds: ``fill`` writes what arrived,
    then the read fails with EIO (as a broken disk would).  Yields the list of failed reads' offsets."""
    real, failed = os.preadv, []

    def failing(fd: int, buffers: list[memoryview], offset: int) -> int:
        if len(failed) < times and "shardwise" in os.readlink(f"/proc/self/fd/{fd}") and when():
            failed.append(offset)
            fill(buffers[0])
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset)

    os.preadv = failing  # type: ignore[assignment]
    try:
        yield failed
    finally:
        os.preadv = real


def _half_nan(view: memoryview) -> None:
    torch.frombuffer(view, dtype=torch.float32)[: len(view) // 8].fill_(float("nan"))


def test_a_failed_shard_read_leaves_the_shard_in_its_file_and_the_unit_sharded(tmp_path: Path) -> None:
    """EIO half-way through reading `embed`'s shard: `OffloadIOError` naming the unit; nothing half-read is
    kept, used, or written back, and the forward that failed runs again on the right weights."""
    engine = _engine(tmp_path)
    _train(engine, 0, 1)
    unit = _unit(engine, "embed.weight")
    truth = _in_file(engine, unit)
    with torch.no_grad():
        want = engine(batch(9, 0)[0]).clone()
    for touch in (lambda: unit.shard, lambda: engine(batch(9, 0)[0])):
        with _failing_reads(_half_nan) as failed, torch.no_grad(), pytest.raises(OffloadIOError) as info:
            touch()
        assert failed and "the shard of `embed.weight`" in str(info.value), info.value
        assert unit.state is UnitState.SHARDED and unit.storage.held_bytes() == 0
        assert torch.equal(unit.shard, truth)  # read again, whole
        unit.write_shard([(0, torch.ones(4))])  # written in host memory: written back when it leaves
        unit.write_shard([(0, truth[:4])])
        unit.shard_released()
        assert torch.equal(_in_file(engine, unit), truth)
    with torch.no_grad():
        assert torch.equal(engine(batch(9, 0)[0]), want)
    engine.destroy()


def test_an_interrupted_shard_read_in_a_forward_leaves_the_unit_sharded(tmp_path: Path) -> None:
    """Ctrl-C while a forward reads a shard (the second half never arrived): the unit stays sharded with
    no host copy, and the re-run forward reads the shard again."""
    engine = _engine(tmp_path)
    _train(engine, 0, 2)
    with torch.no_grad():
        want = engine(batch(9, 0)[0]).clone()
    real = NvmeFiles.read_into

    def interrupted(self: NvmeFiles, name: str, out: torch.Tensor, offset: int = 0, where: str = "") -> None:
        NvmeFiles.read_into = real  # type: ignore[method-assign]
        real(self, name, out, offset, where)
        out.view(-1)[out.numel() // 2:].fill_(123.0)
        raise KeyboardInterrupt

    NvmeFiles.read_into = interrupted  # type: ignore[method-assign]
    try:
        with torch.no_grad(), pytest.raises(KeyboardInterrupt):
            engine(batch(9, 0)[0])
    finally:
        NvmeFiles.read_into = real  # type: ignore[method-assign]
    assert [u.state for u in engine.strategy.units[:2]] == [UnitState.SHARDED] * 2
    assert engine.strategy.shards.held_numel() == 0
    with torch.no_grad():
        assert torch.equal(engine(batch(9, 0)[0]), want)
    engine.destroy()


def test_a_failed_read_ahead_is_raised_once_naming_the_unit(tmp_path: Path) -> None:
    """The read ahead of `fc2`'s shard fails on the I/O thread: the forward that gathers it raises an
    `OffloadIOError` naming the unit and saying the read ahead was dropped; the unit stays sharded, and the
    next forward reads the shard again and trains as a run without the fault."""
    reference = _engine(tmp_path / "reference")
    _train(reference, 0, 3)
    engine = _engine(tmp_path / "nvme")
    _train(engine, 0, 2)
    on_io_thread = lambda: threading.current_thread().name.startswith("shardwise-param-io")  # noqa: E731
    with _failing_reads(lambda view: None, on_io_thread) as failed, pytest.raises(OffloadIOError) as info:
        engine(*batch(2, 0))
    message = str(info.value)
    assert failed and "the shard of `fc2.weight` and 1 more" in message, message
    assert "The read ahead was dropped: the next use of this shard reads it again" in message, message
    fc2 = _unit(engine, "fc2.weight")
    assert fc2.state is UnitState.SHARDED and fc2.storage.pending is None  # type: ignore[attr-defined]
    _train(engine, 2, 1)
    with shardwise.zero.GatheredParameters(list(engine.module.parameters())):
        got = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    with shardwise.zero.GatheredParameters(list(reference.module.parameters())):
        for name, param in reference.module.named_parameters():
            assert torch.equal(got[name], param.detach()), name
    for each in (engine, reference):
        each.destroy()


def test_a_write_into_a_shard_whose_read_ahead_failed_goes_to_the_file(tmp_path: Path) -> None:
    """A step publishing into a shard whose read ahead failed: the read ahead is dropped, not raised (its
    values were never used), and the parts are written into the file."""
    engine = _engine(tmp_path)
    unit = _unit(engine, "fc2.weight")
    expected = _in_file(engine, unit)
    expected[:3] = torch.tensor([1.0, 2.0, 3.0])
    on_io_thread = lambda: threading.current_thread().name.startswith("shardwise-param-io")  # noqa: E731
    with _failing_reads(lambda view: None, on_io_thread) as failed:
        unit.read_ahead()
        unit.write_shard([(0, torch.tensor([1.0, 2.0, 3.0]))])
    assert failed and unit.storage.pending is None  # type: ignore[attr-defined]
    unit.shard_released()
    assert torch.equal(_in_file(engine, unit), expected)
    engine.destroy()


def test_a_unit_gathering_with_no_all_gather_in_flight_refuses_to_finish(tmp_path: Path) -> None:
    """An all-gather that raised as it started leaves the unit gathering with an unfilled buffer: `wait()`
    raises a `UnitError` naming the unit instead of calling it gathered."""
    engine = _engine(tmp_path)
    unit = _unit(engine, "fc2.weight")
    comm = unit.comm

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("all-gather failed (injected)")

    real, comm.all_gather = comm.all_gather, broken  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError, match="injected"):
            unit.gather(async_op=True)
    finally:
        comm.all_gather = real  # type: ignore[method-assign]
    with pytest.raises(UnitError, match=r"rank 0: Unit\(1, \['fc2.weight', 'fc2.bias'\].*no all-gather is in flight"):
        unit.wait()
    assert unit.state is UnitState.GATHERING


def test_max_in_cpu_holds_after_every_path_that_reads_shards(tmp_path: Path) -> None:
    """`max_in_cpu: 0`: no shard stays in host memory after a step (the persistent unit is re-gathered),
    `full_state_dict`, a thaw, or `zero.load_state_dict`."""
    engine = _engine(tmp_path)
    cache = engine.strategy.shards
    _train(engine, 0, 1)
    assert cache.held_numel() == 0, "after a step"
    state = engine.full_state_dict()
    assert cache.held_numel() == 0, "after full_state_dict"
    engine.module.fc2.weight.requires_grad_(False)
    engine.refresh_trainable()
    engine.module.fc2.weight.requires_grad_(True)
    engine.refresh_trainable()
    assert cache.held_numel() == 0, "after a freeze and thaw"
    shardwise.zero.load_state_dict(engine.module, state)
    assert cache.held_numel() == 0, "after zero.load_state_dict"
    engine.destroy()


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(32, 32) for _ in range(4))

    def forward(self, x: torch.Tensor, short: bool = False) -> torch.Tensor:
        x = self.a(x)
        return x.sum() if short else self.d(self.c(self.b(x))).sum()


def test_a_read_ahead_the_pass_did_not_use_does_not_stay_pending(tmp_path: Path) -> None:
    """The full path recorded a, b, c, d; a short pass (a only) read b and c ahead: at its end they leave
    host memory (`max_in_cpu: 0`) and free their read-ahead slots."""
    torch.manual_seed(0)
    engine = _engine(tmp_path, _Branchy())
    x = torch.randn(4, 32)
    engine.backward(engine(x))
    engine.step()
    cache = engine.strategy.shards
    with torch.no_grad():
        engine(x)
        engine(x, short=True)
    assert cache.ahead_hits > 0  # read aheads happen at all
    assert cache.reading_ahead() == 0 and cache.held_numel() == 0, [s.owner.label for s in cache.resident]
    engine.destroy()


def test_a_thawed_master_is_a_copy_not_a_view_of_the_shard(tmp_path: Path) -> None:
    """fp32 with shards in files: a piece frozen at initialize and thawed gets a master of its own."""
    model = make_model()
    model.embed.weight.requires_grad_(False)
    engine = _engine(tmp_path, model)
    engine.module.embed.weight.requires_grad_(True)
    engine.refresh_trainable()
    piece = next(p for p in engine.strategy.store.pieces if p.name == "embed.weight")
    assert piece.key is not None and piece.key._base is None
    assert torch.equal(piece.key, piece.unit.shard.narrow(0, piece.offset, piece.numel))
    assert piece.key.data_ptr() != piece.unit.shard.data_ptr()
    engine.destroy()


def test_destroy_writes_nothing_back_into_the_file_it_deletes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Host copies written by the step (kept: `max_in_cpu` room for about one shard) are not written back
    while `destroy` gathers every unit and deletes the file."""
    engine = _engine(tmp_path, max_in_cpu=1100)
    _train(engine, 0, 2)
    writes: list[int] = []
    real = NvmeFiles.write_from

    def counted(self: NvmeFiles, name: str, data: torch.Tensor, offset: int = 0, where: str = "") -> None:
        writes.append(offset)
        real(self, name, data, offset, where)

    monkeypatch.setattr(NvmeFiles, "write_from", counted)
    engine.destroy()
    assert writes == [] and os.listdir(tmp_path) == []


def test_destroy_holds_one_shard_at_a_time_not_every_one_it_read(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`destroy` reads every unit's shard to give the parameters their values: each host copy leaves once its
    unit is restored (`max_in_cpu: 0`), so the shards held never add up to the model's (a model offloaded
    because it does not fit would not fit here either: 2 bytes a parameter a rank at 2 ranks, fp32)."""
    torch.manual_seed(0)
    engine = _engine(tmp_path, _Branchy())
    engine.backward(engine(torch.randn(4, 32)))
    engine.step()
    cache = engine.strategy.shards
    largest = max(u.shard_numel for u in engine.strategy.units)
    held: list[int] = []
    real = NvmeShard.get

    def counted(self: NvmeShard) -> torch.Tensor:
        tensor = real(self)
        held.append(cache.held_numel())
        return tensor

    monkeypatch.setattr(NvmeShard, "get", counted)
    engine.destroy()
    assert len(held) >= 4 and max(held) <= largest, (held, largest)
    assert torch.isfinite(engine.module.d.weight).all()  # the parameters were restored all the same


def test_destroy_without_restoring_reads_no_shard_and_leaves_the_parameters_empty(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`destroy(restore_params=False)`, for a model no rank could hold whole: no shard is read nor gathered,
    the parameters are left empty and plain, and the offload folders are gone."""
    torch.manual_seed(0)
    engine = _engine(tmp_path, _Branchy())
    engine.backward(engine(torch.randn(4, 32)))
    engine.step()
    reads: list[str] = []
    real = NvmeShard.get

    def counted(self: NvmeShard) -> torch.Tensor:
        reads.append(self.owner.label)
        return real(self)

    monkeypatch.setattr(NvmeShard, "get", counted)
    module = engine.module
    engine.destroy(restore_params=False)
    assert reads == []
    for name, param in module.named_parameters():
        assert type(param) is nn.Parameter and param.numel() == 0, name
    assert os.listdir(tmp_path) == []


def test_a_destroy_retried_after_a_failed_read_goes_on_without_stale_values(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard's read fails in the middle of `destroy` (the units before it restored, their newer host copies
    let go unwritten): a second `destroy` goes on from the failed unit and every parameter ends as trained."""
    engine = _engine(tmp_path, max_in_cpu=10**9)  # host copies kept: newer than the file after the steps
    _train(engine, 0, 3)
    module = engine.module
    with shardwise.zero.GatheredParameters(list(module.parameters())):
        trained = {n: p.detach().clone() for n, p in module.named_parameters()}
    victim = engine.strategy.units[1].storage
    real = NvmeShard.get
    failed: list[bool] = []

    def failing_once(self: NvmeShard) -> torch.Tensor:
        if self is victim and not failed:
            failed.append(True)
            raise OSError(errno.EIO, "injected read error")
        return real(self)

    monkeypatch.setattr(NvmeShard, "get", failing_once)
    with pytest.raises(OSError, match="injected"):
        engine.destroy()
    engine.destroy()
    for name, param in module.named_parameters():
        assert torch.equal(param.detach(), trained[name]), name
    assert os.listdir(tmp_path) == []
