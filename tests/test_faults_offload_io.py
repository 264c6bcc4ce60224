"""An I/O error of NVMe optimizer offload mid-training: a clear error on that rank, the peer told, nothing hangs.

Rank 1's offload I/O fails in the background thread at its fourth step (stages 1 and 2): a write finds the
disk full (ENOSPC), a read finds the disk broken (EIO), or a file was removed under the job (ENOENT).
Faults are injected for real: ``os.pwrite``/``os.preadv`` replaced in rank 1's process for its offload
folder's files only, or the file unlinked.  Rank 1 must raise `OffloadIOError` naming the rank, the file,
the operation, the sub-group and the fix, with every pool buffer back (the next step would otherwise wait
forever); rank 0 must raise `PeerFailedError` quoting it within `comms.timeout` (3 s here).  A disk that
stalls longer than `comms.timeout` is named busy in `step`.  In one process: what the half-updated engine
refuses afterwards (step, save), and that a new engine loading the last checkpoint trains on to the
weights of a run without the fault (atol 1e-6); a failed write stops the pipeline at once; a failure
writing the initial masters, and a state file cut short, are errors naming the file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from _faults_common import COMMS_TIMEOUT, VICTIM, bounded_outcome, fault_config, outcome, record_row, train_step
from _parity import assert_close_params, batch, make_model

import shardwise
from shardwise.testing import run_distributed
from shardwise.zero.offload.files import OffloadIOError
from shardwise.zero.store.subgroups import BufferPool, pipelined

#: the parity model's shard (about 1,100 elements a rank) in several sub-groups, each a few hundred
SUB_GROUP = 300
ATOL = 1e-6


def _offload(nvme: str) -> dict[str, Any]:
    return {"offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 3},
            "sub_group_size": SUB_GROUP}


def _engine(nvme: str, stage: int = 2) -> Any:
    model = make_model()
    config = fault_config(stage, zero_optimization=_offload(nvme))
    return shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)


@contextlib.contextmanager
def _failing_syscall(name: str, code: int, folder: Path) -> Iterator[None]:
    """Inside, ``os.<name>`` fails with ``code`` on files of ``folder`` (the offload I/O), as a broken disk would."""
    real = getattr(os, name)

    def failing(fd: int, *args: Any) -> Any:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(folder)):
            raise OSError(code, os.strerror(code))
        return real(fd, *args)

    setattr(os, name, failing)
    try:
        yield
    finally:
        setattr(os, name, real)


@contextlib.contextmanager
def _removed(folder: Path) -> Iterator[None]:
    """The optimizer's first moment is deleted from under the job (a clean-up run on `nvme_path`)."""
    os.unlink(folder / "exp_avg")
    yield


FAULTS: dict[str, tuple[Callable[[Path], Any], str, str]] = {
    # fault -> (injection, operation named, the fix named)
    "the disk fills (ENOSPC on a write)": (lambda f: _failing_syscall("pwrite", errno.ENOSPC, f), "writing",
                                           "the disk under `zero_optimization.offload_optimizer.nvme_path` is full"),
    "the disk fails (EIO on a read)": (lambda f: _failing_syscall("preadv", errno.EIO, f), "reading",
                                       "the disk reported an error: check its health"),
    "a state file is removed under the job (ENOENT)": (_removed, "reading",
                                                       "the file was removed while the job used it"),
}


def _fault_mid_training(nvme: str, fault: str, stage: int) -> dict[str, Any]:
    engine = _engine(nvme, stage)
    for step in range(3):
        train_step(engine, step)
    masters = engine.strategy.store.home
    inject = FAULTS[fault][0]
    with inject(masters.files.folder) if dist.get_rank() == VICTIM else contextlib.nullcontext():
        # rank 0's fourth step ends with the parameters' all-gather in flight: its fifth waits on rank 1
        result = outcome(lambda: [train_step(engine, step) for step in (3, 4)])
    # every buffer is back in the pool: counting them takes each once (it would block on a missing one)
    held = bounded_outcome(masters.pool.nbytes, 10.0)
    result["pool_whole"] = held["error"] is None
    result["folder"] = str(masters.files.folder)
    result["groups"] = len(masters.stepper.groups)
    return result


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_an_offload_io_error_names_rank_file_operation_and_fix(fault: str, stage: int, tmp_path: Path) -> None:
    survivor, victim = run_distributed(_fault_mid_training, 2, args=(str(tmp_path), fault, stage), timeout=90)
    _, operation, fix = FAULTS[fault]
    assert victim["error"] == "OffloadIOError", victim
    message = victim["message"]
    assert message.startswith(f"rank 1: offloaded optimizer state: {operation} "), message
    assert f"of {victim['folder']}/" in message, message  # the file, by its full path
    assert f"(sub-group 1 of {victim['groups']}: elements 0-" in message, message
    assert fix in message, message
    assert "this engine now refuses to step or save; restart from the last checkpoint" in message, message
    assert victim["pool_whole"], "a pool buffer was not given back: the next step would wait forever"
    assert survivor["error"] == "PeerFailedError" and survivor["failed"] == [VICTIM], survivor
    assert "OffloadIOError" in survivor["message"], survivor
    assert survivor["seconds"] < COMMS_TIMEOUT, survivor
    assert survivor["pool_whole"]
    record_row("disagree", f"NVMe offload: {fault} on rank 1, in the I/O thread", str(stage),
               "rank 1 raises `OffloadIOError` naming the file, operation, sub-group and fix, pool buffers "
               "returned; rank 0 raises `PeerFailedError` quoting it", survivor["seconds"])


#: `comms.timeout` of the stalled-disk test, and how long rank 1's disk stalls (longer: rank 0 must not wait it out)
STALL_TIMEOUT, STALL_S = 1.5, 2.5


def _stall_mid_training(nvme: str) -> dict[str, Any]:
    model = make_model()
    config = fault_config(2, zero_optimization=_offload(nvme), comms={"timeout": STALL_TIMEOUT})
    engine = shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    for step in range(3):
        train_step(engine, step)
    folder, real, once = engine.strategy.store.home.files.folder, os.pwrite, threading.Event()

    def stalled(fd: int, *args: Any) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(folder)) and not once.is_set():
            once.set()
            time.sleep(STALL_S)  # the disk stops answering for a while, then answers
        return real(fd, *args)

    if dist.get_rank() == VICTIM:
        os.pwrite = stalled
    return outcome(lambda: [train_step(engine, step) for step in (3, 4)])


def test_a_stalled_disk_is_named_busy_in_step_at_the_timeout(tmp_path: Path) -> None:
    """Rank 1's offload write stalls longer than `comms.timeout`: rank 0 gives up at the timeout naming rank 1
    alive and busy in `step` (not a wait as long as the disk's), and rank 1 fails once it comes back."""
    survivor, stalled = run_distributed(_stall_mid_training, 2, args=(str(tmp_path),), timeout=90)
    assert survivor["error"] == "CommError", survivor
    message = survivor["message"]
    assert f"within `comms.timeout` = {STALL_TIMEOUT:g} s" in message, message
    assert "rank 1: busy in `step` of engine" in message, message
    assert STALL_TIMEOUT <= survivor["seconds"] < STALL_S, survivor
    assert stalled["error"] is not None, "rank 1 cannot finish its next step once rank 0 gave up"
    record_row("disagree", "NVMe offload: rank 1's disk stalls (a write waits longer than `comms.timeout`)", "2",
               "rank 0 raises `CommError` at `comms.timeout`: rank 1 is alive and busy in `step`",
               survivor["seconds"])


def _weights(engine: Any) -> dict[str, torch.Tensor]:
    """The engine's full parameters (one process: rank 0 holds them; at stage 3 gathered by `full_state_dict`)."""
    names = {name for name, _ in engine.module.named_parameters()}
    return {k: v for k, v in engine.full_state_dict().items() if k in names}


def _plain_steps(engine: Any, first: int, count: int) -> None:
    for step in range(first, first + count):
        engine.backward(engine(*batch(step, 0)))
        engine.step()


@pytest.mark.parametrize("stage", [2, 3])
def test_an_engine_whose_offloaded_step_failed_refuses_to_step_or_save(stage: int, tmp_path: Path) -> None:
    """One process: after a write failed mid-step the files hold a half-updated state; the engine refuses
    to step or save on it (at stage 3 as at stages 1-2: before, a retried step stepped the sub-groups done
    already a second time), and a new engine from the last checkpoint trains as if nothing happened."""
    reference = _engine(str(tmp_path / "reference"), stage)
    _plain_steps(reference, 0, 5)
    engine = _engine(str(tmp_path / "nvme"), stage)
    _plain_steps(engine, 0, 3)
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="three")
    arrangement = engine.strategy.store.home
    folder = arrangement.files.folder
    with _failing_syscall("pwrite", errno.ENOSPC, folder), pytest.raises(OffloadIOError):
        _plain_steps(engine, 3, 1)
    # a retried step is refused by the engine itself (any step that raised partway; shardwise.engine.engine), a save by
    # the offloaded state
    refused = ("offloaded optimizer state is incomplete since a step failed", r"the last `engine.step\(\)`.* raised")
    for action, match in ((engine.step, refused[1]), (lambda: engine.save_checkpoint(str(tmp_path / "ckpt")), refused[0])):
        with pytest.raises(RuntimeError, match=match):
            action()
    assert (tmp_path / "ckpt" / "latest").read_text() == "three"
    engine.destroy()
    fresh = _engine(str(tmp_path / "nvme"), stage)
    fresh.load_checkpoint(str(tmp_path / "ckpt"), tag="three")
    _plain_steps(fresh, 3, 2)
    assert_close_params(_weights(fresh), _weights(reference), atol=ATOL)
    for each in (fresh, reference):
        each.destroy()
    assert not folder.exists() and os.listdir(tmp_path / "nvme") == []


def test_a_disk_that_fails_while_initialize_writes_the_masters_is_an_error_there(tmp_path: Path) -> None:
    """ENOSPC on the first write of the initial masters: `OffloadIOError` at `initialize`, no folder left."""
    with _failing_syscall("pwrite", errno.ENOSPC, tmp_path), pytest.raises(OffloadIOError) as info:
        _engine(str(tmp_path))
    message = str(info.value)
    assert message.startswith("rank 0: offloaded optimizer state: writing "), message
    assert "/master (the initial masters) failed: ENOSPC (No space left on device)" in message, message
    assert os.listdir(tmp_path) == [], "the refused engine's folder is removed"


def test_a_failed_write_stops_the_step_at_once_with_every_buffer_back() -> None:
    """The I/O pipeline alone: sub-group 0's write fails; the loop raises right after stepping sub-group 1
    (the first point it looks, once that write ended), not after stepping all ten, and the pool is whole."""
    pool = BufferPool(3, 64)
    written = threading.Event()
    stepped: list[int] = []

    def failing_write() -> None:
        try:
            raise OSError(errno.EIO, "injected")
        finally:
            written.set()

    def step(index: int, buffer: torch.Tensor) -> Callable[[], None]:
        if index == 1:
            assert written.wait(10.0)  # sub-group 0's write has ended (failed) before sub-group 1's is queued
        stepped.append(index)
        return failing_write if index == 0 else (lambda: None)

    with pytest.raises(OSError, match="injected"):
        pipelined(range(10), [64] * 10, pool, lambda index, buffer: None, step)
    assert stepped == [0, 1], stepped
    assert pool.nbytes() == 3 * 64


def test_a_truncated_state_file_is_an_error_at_save_not_zeros_or_a_crash(tmp_path: Path) -> None:
    """A state file cut short under the job: a checkpoint's map of it would have grown it with zeros (torch's
    `from_file`) or crashed the process with SIGBUS past its end; it is an `OffloadIOError` naming the file."""
    engine = _engine(str(tmp_path / "nvme"))
    _plain_steps(engine, 0, 2)
    cut = engine.strategy.store.home.files.path("exp_avg_sq")
    os.truncate(cut, 100)
    with pytest.raises(Exception) as info:
        engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    chain = [info.value, info.value.__cause__, info.value.__context__]
    assert any(isinstance(e, OffloadIOError) for e in chain), repr(info.value)
    message = str(info.value)
    assert "mapping " in message and f"of {cut} failed: EIO (the file holds 100 bytes, fewer than" in message, message
    assert "the file was cut short while the job used it" in message, message
    assert not (tmp_path / "ckpt" / "t").exists()
    engine.destroy()


def test_a_buffer_that_cannot_grow_stays_in_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Growing a pool buffer runs out of memory: the error is raised and the old buffer is still counted."""
    pool = BufferPool(2, 64)
    real = torch.empty

    def no_memory(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise MemoryError("injected: no memory for a larger buffer")

    monkeypatch.setattr(torch, "empty", no_memory)
    with pytest.raises(MemoryError, match="injected"):
        pipelined([0], [128], pool, lambda index, buffer: None, lambda index, buffer: (lambda: None))
    monkeypatch.setattr(torch, "empty", real)
    assert bounded_outcome(pool.nbytes, 10.0)["error"] is None, "a buffer was lost: counting them waits forever"
    assert pool.nbytes() == 2 * 64
