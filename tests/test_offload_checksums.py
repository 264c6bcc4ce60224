"""Offload files are verified: bytes changed under the job are an error, never trained on or saved.

Each run of bytes a rank writes into its NVMe offload files (a sub-group's `master`, `exp_avg`, `exp_avg_sq`;
a unit's shard in `params`) carries a digest kept in memory, checked when the bytes are read back.  Here a
file is changed between steps as another process or a failing disk would: a few bytes flipped in the middle
of a sub-group (or a shard), the file cut short, or removed.  In one process, at stages 1-3 and for stage 3's
parameter shards: the next step (or forward) raises an error naming the rank, the file, the sub-group (or the
unit) and what to do; the engine then refuses to step or save, and no checkpoint is written after it.  Bytes
changed right after a save, or after the last step and before a save, are caught too (the save's maps are
checked, and their digests taken anew once freed).  Also the write side of the pipeline: when the last write
of a step fails (ENOSPC), the step raises and the engine refuses to step or save (before this test, a
mutation that stopped `readahead.pipelined` from waiting on a step's final writes survived every offload
test).  On 2 ranks, with the default `comms.timeout`: rank 1's corrupted file is an error on rank 1, and
rank 0, waiting in the step's collectives while rank 1 stays alive, raises within seconds.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from _faults_common import VICTIM, outcome, record_row
from _parity import batch, make_model

import shardwise
from shardwise.testing import run_distributed
from shardwise.zero.offload.files import OffloadChecksumError, OffloadIOError

#: the parity model's shard (about 2,200 elements in one process) in several sub-groups of a few hundred
SUB_GROUP = 300
#: seconds rank 0 may take to raise once rank 1 failed (the default `comms.timeout` is 300)
PEER_WITHIN_S = 10.0


def _config(nvme: Path, stage: int, params: bool = False) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "sub_group_size": SUB_GROUP, "stage3_param_persistence_threshold": 0,
                            "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme), "buffer_count": 3}}
    if params:
        zero["offload_param"] = {"device": "nvme", "nvme_path": str(nvme), "max_in_cpu": 0}
    return {"zero_optimization": zero}


def _engine(nvme: Path, stage: int, params: bool = False) -> Any:
    model = make_model()
    return shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), _config(nvme, stage, params))


def _steps(engine: Any, first: int, count: int, rank: int = 0) -> None:
    for step in range(first, first + count):
        engine.backward(engine(*batch(step, rank)))
        engine.step()


def _files(engine: Any, kind: str) -> Any:
    """The offload files holding ``kind``."""
    strategy = engine.strategy
    if kind == "params":
        return strategy.shards.files
    return strategy.store.home.files


def _middle(engine: Any, kind: str) -> int:
    """A byte in the middle of the second sub-group's run of ``kind`` (or of a unit's shard in `params`)."""
    if kind == "params":
        stored = next(u for u in engine.strategy.units if "fc2.weight" in u.names).storage
        return int(stored.offset) + stored.numel * stored.dtype.itemsize // 2
    arrangement = engine.strategy.store.home
    stepper = arrangement.stepper
    group = stepper.groups[1]
    return ((group.start + group.end) // 2 - stepper.resident) * 4


def _groups(engine: Any) -> list[Any]:
    """The sub-groups of the engine's offloaded optimizer state on this rank."""
    strategy = engine.strategy
    return strategy.store.home.stepper.groups


def _flip(path: Path, at: int, count: int = 4) -> None:
    """Invert ``count`` bytes of ``path`` at ``at``, as another process writing into the file would."""
    with open(path, "r+b") as handle:
        handle.seek(at)
        old = handle.read(count)
        handle.seek(at)
        handle.write(bytes(b ^ 0xFF for b in old))


#: what is done to a file, and what the error then says about it
FAULTS: dict[str, tuple[Callable[[Path, int], None], str]] = {
    "bytes flipped": (_flip, "changed since this rank wrote them"),
    "cut short": (lambda path, at: os.truncate(path, at), "the file was cut short while the job used it"),
    "removed": (lambda path, at: os.unlink(path), "the file was removed while the job used it"),
}

CASES = [(1, "master", "bytes flipped"), (2, "master", "bytes flipped"), (2, "exp_avg_sq", "bytes flipped"),
         (3, "master", "bytes flipped"), (3, "exp_avg_sq", "bytes flipped"), (3, "params", "bytes flipped"),
         (2, "exp_avg", "cut short"), (3, "master", "removed"), (3, "params", "cut short")]


#: what the engine says when it refuses to step or save after its files lost the state
#: the offload layer's refusal, or the engine's own after a step that raised (it refuses first since issue 34's
#: exception safety: a step that raised after the ranks agreed may have left the state partly updated)
REFUSED = (r"cannot (step|save or load a checkpoint): this engine's offloaded optimizer state"
           r"|these files are not read or written since"
           r"|refused: the last `engine.step\(\)` of .* raised \(`Offload(Checksum|IO)Error")


def _refuses_to_step_and_save(engine: Any, ckpt: Path, retry: Callable[[], Any]) -> None:
    """``retry`` (the call that failed, again) and a save raise saying why; nothing is saved."""
    for action in (retry, lambda: engine.save_checkpoint(str(ckpt), tag="after")):
        with pytest.raises((RuntimeError, OffloadIOError), match=REFUSED):
            action()
    assert (ckpt / "latest").read_text() == "before" and not (ckpt / "after").exists()


def _full_step(engine: Any, step: int) -> Callable[[], None]:
    return lambda: _steps(engine, step, 1)


# a shard that fails to read in a forward leaves no unit gathering without its all-gather, nor one that the
# always-called post-forward hook then frees twice (torch only warns of an error in that hook: made one here)
@pytest.mark.filterwarnings("error:module forward hook:UserWarning")
@pytest.mark.parametrize(("stage", "kind", "fault"), CASES)
def test_a_changed_offload_file_is_an_error_and_nothing_after_it_is_saved(stage: int, kind: str, fault: str,
                                                                        tmp_path: Path) -> None:
    engine = _engine(tmp_path / "nvme", stage, params=kind == "params")
    _steps(engine, 0, 2)
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="before")
    _steps(engine, 2, 1)
    files = _files(engine, kind)
    change, said = FAULTS[fault]
    change(files.path(kind), _middle(engine, kind))
    start = time.monotonic()
    with pytest.raises(OffloadIOError) as info:
        _steps(engine, 3, 1)
    seconds = time.monotonic() - start
    message = str(info.value)
    assert message.startswith("rank 0: "), message
    assert f"{files.path(kind)}" in message and said in message, message
    sub_group = 1 if fault == "removed" else 2  # a removed file fails the first read of the step
    where = "the shard of `fc2.weight`" if kind == "params" else f"(sub-group {sub_group} of {len(_groups(engine))}: "
    assert where in message, message
    assert "restart from the last checkpoint" in message, message
    if fault == "bytes flipped":
        assert isinstance(info.value, OffloadChecksumError) and "Nothing read from it was used" in message, message
    # the forward failed before its backward (a shard) or the step did (optimizer state): retried as it failed
    _refuses_to_step_and_save(engine, tmp_path / "ckpt", _full_step(engine, 3) if kind == "params" else engine.step)
    if kind == "params":  # the full weights cannot be given back: the shard in the file is lost
        with pytest.raises(OffloadIOError, match="these files are not read or written since"):
            engine.destroy()
    engine.destroy(restore_params=kind != "params")
    assert os.listdir(tmp_path / "nvme") == []
    what, part = ("a forward", "unit") if kind == "params" else ("the step", "sub-group")
    record_row("disagree", f"NVMe offload: `{kind}` {fault} between steps (one rank)", str(stage),
               f"{what} raises `{type(info.value).__name__}` naming the rank, file, {part} and fix; the engine then "
               "refuses to step or save, no checkpoint is written", seconds)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("when", ["after a save", "before a save"])
def test_bytes_changed_around_a_save_are_caught(stage: int, when: str, tmp_path: Path) -> None:
    """A save maps the files: their digests are checked at the map (a save after the change raises and writes
    nothing) and taken anew from the file once the maps are freed (a change after the save is caught by the
    next step, not trusted)."""
    engine = _engine(tmp_path / "nvme", stage)
    _steps(engine, 0, 2)
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="before")
    files = _files(engine, "exp_avg_sq")
    _flip(files.path("exp_avg_sq"), _middle(engine, "exp_avg_sq"))
    action = (lambda: engine.save_checkpoint(str(tmp_path / "ckpt"), tag="after")) if when == "before a save" \
        else (lambda: _steps(engine, 2, 1))
    with pytest.raises(Exception) as info:
        action()
    chain = [info.value, info.value.__cause__, info.value.__context__]
    assert any(isinstance(e, OffloadChecksumError) for e in chain), repr(info.value)
    assert "changed since this rank wrote them" in str(info.value) and "(sub-group 2 of " in str(info.value), info.value
    _refuses_to_step_and_save(engine, tmp_path / "ckpt", _full_step(engine, 2) if when == "before a save" else engine.step)
    engine.destroy()


def test_loading_a_checkpoint_writes_through_the_maps_and_trains_on(tmp_path: Path) -> None:
    """A load writes the files through maps: their digests are taken anew once the maps are freed, so the next
    steps read them back without a false alarm, to the weights of a run without the load."""
    reference = _engine(tmp_path / "reference", 2)
    _steps(reference, 0, 4)
    engine = _engine(tmp_path / "nvme", 2)
    _steps(engine, 0, 2)
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="two")
    _steps(engine, 2, 3)  # moves on, then goes back
    engine.load_checkpoint(str(tmp_path / "ckpt"), tag="two")
    _steps(engine, 2, 2)
    for (name, got), want in zip(engine.module.named_parameters(), reference.module.parameters()):
        assert torch.equal(got, want), name
    _flip(_files(engine, "master").path("master"), _middle(engine, "master"))
    with pytest.raises(OffloadChecksumError):
        _steps(engine, 4, 1)
    for each in (engine, reference):
        each.destroy()


@pytest.mark.parametrize("stage", [2, 3])
def test_a_failed_last_write_of_a_step_is_raised_and_the_engine_refuses_to_go_on(stage: int, tmp_path: Path) -> None:
    """ENOSPC on the very last write of a step (the last sub-group's `exp_avg_sq`): the step waits for it and
    raises; the engine refuses to step or save (the file keeps the old state of that sub-group)."""
    engine = _engine(tmp_path / "nvme", stage)
    _steps(engine, 0, 2)
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="before")
    files, groups = _files(engine, "exp_avg_sq"), _groups(engine)
    last = (groups[-1].start - engine.strategy.store.home.resident) * 4
    with _failing_write_at(files.path("exp_avg_sq"), last), pytest.raises(OffloadIOError) as info:
        _steps(engine, 2, 1)
    message = str(info.value)
    assert "writing " in message and f"at byte {last:,} of {files.path('exp_avg_sq')}" in message, message
    assert f"(sub-group {len(groups)} of {len(groups)}: " in message and "ENOSPC" in message, message
    _refuses_to_step_and_save(engine, tmp_path / "ckpt", engine.step)
    engine.destroy()


@contextlib.contextmanager
def _failing_write_at(path: Path, offset: int) -> Iterator[None]:
    """``os.pwrite`` fails with ENOSPC for a write of ``path`` at ``offset`` (the disk fills right then)."""
    real = os.pwrite

    def failing(fd: int, data: Any, at: int) -> int:
        if at == offset and os.readlink(f"/proc/self/fd/{fd}") == str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, at)

    os.pwrite = failing
    try:
        yield
    finally:
        os.pwrite = real


def _corrupted_on_one_rank(nvme: str) -> dict[str, Any]:
    engine = _engine(Path(nvme), 2)
    _steps(engine, 0, 2, dist.get_rank())
    if dist.get_rank() == VICTIM:
        _flip(_files(engine, "master").path("master"), _middle(engine, "master"))
    result = outcome(lambda: _steps(engine, 2, 2, dist.get_rank()))
    if dist.get_rank() == VICTIM:
        time.sleep(PEER_WITHIN_S + 5)  # alive and elsewhere (a script that caught the error): not gone
    return result


def test_a_corrupted_file_on_one_rank_is_an_error_on_every_rank_within_seconds(tmp_path: Path) -> None:
    """Rank 1's `master` is changed between steps; with the default `comms.timeout` (300 s), rank 1 raises the
    checksum error and rank 0 raises naming it within seconds, although rank 1 stays alive."""
    survivor, victim = run_distributed(_corrupted_on_one_rank, 2, args=(str(tmp_path),), timeout=120)
    assert victim["error"] == "OffloadChecksumError", victim
    assert "rank 1: offloaded optimizer state: reading " in victim["message"], victim
    assert survivor["error"] is not None and survivor["seconds"] < PEER_WITHIN_S, survivor
    assert "OffloadChecksumError" in survivor["message"], survivor
    record_row("disagree", "NVMe offload: bytes of rank 1's `master` changed between steps (rank 1 stays alive)",
               "2", "rank 1 raises `OffloadChecksumError` naming the file, sub-group and fix; rank 0 raises "
               "quoting it; neither steps nor saves again", survivor["seconds"])


@pytest.mark.parametrize("seed", range(4))
def test_digests_never_flag_what_this_rank_wrote_and_always_flag_a_change(seed: int, tmp_path: Path) -> None:
    """The files alone, under random writes, reads and maps (some written through, held while other calls run,
    freed in any order) at any offsets and sizes: a read always returns what was written and never raises; then
    a byte changed under a recorded run is caught by the next read or map that covers its run."""
    from shardwise.zero.offload.files import NvmeFiles

    rng = torch.Generator().manual_seed(seed)
    size = 4096
    files = NvmeFiles(str(tmp_path), 0)
    files.create("f", size)
    shadow = torch.zeros(size, dtype=torch.uint8)
    maps: list[tuple[int, torch.Tensor]] = []

    def span() -> tuple[int, int]:
        start = int(torch.randint(0, size - 1, (1,), generator=rng))
        return start, int(torch.randint(1, min(1024, size - start) + 1, (1,), generator=rng))

    for _ in range(400):
        op = int(torch.randint(0, 5, (1,), generator=rng))
        start, count = span()
        if op == 0:  # a write
            values = torch.randint(0, 256, (count,), dtype=torch.uint8, generator=rng)
            files.write_from("f", values, start)
            shadow[start : start + count] = values
        elif op == 1:  # a read
            out = torch.empty(count, dtype=torch.uint8)
            files.read_into("f", out, start)
            assert torch.equal(out, shadow[start : start + count])
        elif op == 2:  # a map, sometimes written through, held for a while
            mapped = files.mapped_range("f", start, count, torch.uint8)
            assert torch.equal(mapped, shadow[start : start + count])
            if bool(torch.randint(0, 2, (1,), generator=rng)):
                values = torch.randint(0, 256, (count,), dtype=torch.uint8, generator=rng)
                mapped.copy_(values)
                shadow[start : start + count] = values
            maps.append((start, mapped))
        elif maps:  # a held map written through later, or freed
            at = int(torch.randint(0, len(maps), (1,), generator=rng))
            where, mapped = maps[at]
            if op == 3:
                mapped.fill_(int(torch.randint(0, 256, (1,), generator=rng)))
                shadow[where : where + mapped.numel()] = mapped
            else:
                del maps[at], mapped
    maps.clear()
    whole = torch.empty(size, dtype=torch.uint8)
    files.read_into("f", whole)  # every byte has a digest from here on
    assert torch.equal(whole, shadow)
    run = files.sums._files["f"].runs[int(torch.randint(0, len(files.sums._files["f"].runs), (1,), generator=rng))]
    _flip(files.path("f"), (run[0] + run[1]) // 2, 1)
    with pytest.raises(OffloadChecksumError, match=rf"found bytes {run[0]:,}-{run[1]:,} changed"):
        if seed % 2:
            files.read_into("f", whole)
        else:
            files.mapped_range("f", (run[0] + run[1]) // 2, 1, torch.uint8)
    with pytest.raises(OffloadChecksumError, match="these files are not read or written since"):
        files.write_from("f", whole[:1], 0)
    files.remove()


def test_the_cost_benchmark_measures_digests_on_and_off(tmp_path: Path) -> None:
    """`benchmarks.offload_checksums`: its candidates run on a buffer, and its "off" arm records no digest."""
    from benchmarks.offload_checksums import _digests, digest_speeds
    from shardwise.zero.offload.files import NvmeFiles

    speeds = digest_speeds([4096])
    assert "XXH3-64 (xxhash)" in speeds and speeds["XXH3-64 (xxhash)"][4096][0] > 0
    files = NvmeFiles(str(tmp_path), 0)
    files.create("f", 64)
    spent: list[float] = []
    with _digests(False, spent):
        files.write_from("f", torch.ones(16))
    assert "f" not in files.sums._files and spent == []
    with _digests(True, spent):
        files.write_from("f", torch.ones(16))
    assert len(files.sums._files["f"].runs) == 1 and spent[1] == 64
    files.remove()


def test_a_map_freed_while_the_digests_are_in_use_is_released_at_the_next_call(tmp_path: Path) -> None:
    """A collection can free a map inside the digests' own lock (any allocation may run it): the release waits
    for the next call instead of deadlocking on the lock, and the digest is then taken anew."""
    import gc

    from shardwise.zero.offload.files import NvmeFiles

    files = NvmeFiles(str(tmp_path), 0)
    files.create("f", 64)
    files.write_from("f", torch.arange(16, dtype=torch.float32))
    mapped = files.mapped_range("f", 0, 16, torch.float32)
    cycle: list[Any] = [mapped]
    cycle.append(cycle)  # freed by the collector, not by a reference count
    mapped.fill_(7.0)
    del mapped
    with files.sums._locked():
        del cycle
        gc.collect()
        assert files.sums.deferred == [("f", 0, 64)]
    out = torch.empty(16)
    files.read_into("f", out)  # releases it first: a digest of the 7s, not a false alarm
    assert torch.equal(out, torch.full((16,), 7.0)) and not files.sums.deferred
    _flip(files.path("f"), 8, 1)
    with pytest.raises(OffloadChecksumError):
        files.read_into("f", out)
    files.remove()
