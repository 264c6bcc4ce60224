"""Jobs sharing one `nvme_path` (docs/offload.md, Faults): killed jobs' folders swept, live ones never touched.

* A job whose rank 1 is killed (SIGKILL) mid-step leaves its ranks' folders; the next job's set-up on the
  host removes them, and leaves alone the folder of a live process, one named after another host (a shared
  file system) and one of another pid namespace (another container).
* Two 2-rank jobs on one `nvme_path` at the same time (they meet before training, so their I/O interleaves)
  each train to the weights of the same stage without offload (atol 1e-6; equal to the bit here).
* Two ranks that each fit the disk alone but not together: the room check counts both (it names each
  rank's bytes and the free space); a rank that passed learns it from the fault layer.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _faults_common import COMMS_TIMEOUT, VICTIM, die, fault_config, outcome, record_row, train_step
from _parity import assert_close_params, make_model, params_of

import shardwise
from shardwise.testing import run_distributed
from shardwise.zero.offload.files import NvmeFiles, Owner, folder_prefix, owner_of, sweep

SUB_GROUP = 300
ATOL = 1e-6
#: seconds a job waits for the other at a meeting point (both start within a few seconds on 2 cores)
MEET_S = 90.0


def _engine(nvme: str | None, stage: int = 2) -> Any:
    model = make_model()
    zero: dict[str, Any] = {}
    if nvme is not None:
        zero = {"offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 3},
                "sub_group_size": SUB_GROUP}
    return shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                fault_config(stage, zero_optimization=zero))


# ------------------------------------------------------------------- a killed job's folders are swept
def _killed_mid_step(nvme: str) -> dict[str, Any]:
    engine = _engine(nvme)
    for step in range(2):
        train_step(engine, step)
    if dist.get_rank() == VICTIM:
        engine.optimizer.inner.step = lambda *args, **kwargs: die()  # inside the offloaded step, I/O in flight
    result = outcome(lambda: [train_step(engine, step) for step in (2, 3)])
    result["folder"] = str(engine.strategy.store.home.files.folder)
    return result


def _next_job(nvme: str) -> list[str]:
    engine = _engine(nvme)
    seen = sorted(os.listdir(nvme))  # after this rank's set-up swept
    train_step(engine, 0)
    engine.destroy()
    dist.barrier()
    return seen


def test_a_killed_jobs_folders_are_swept_by_the_next_job_and_live_ones_kept(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    survivor, _ = run_distributed(_killed_mid_step, 2, args=(str(nvme),), timeout=90, expect_dead=(VICTIM,))
    assert survivor["error"] == "RankGoneError", survivor
    stale = sorted(os.listdir(nvme))  # the harness's ranks end without exit handlers: both folders stay
    assert len(stale) == 2 and any("-rank1-" in name for name in stale), stale
    dead_pid = int(stale[0].split("-pid")[1].split("-")[0])
    live = NvmeFiles(str(nvme), 0)  # this process's: alive through the next job
    live.create("master", 64)
    namespace = stale[0].split("-ns")[1].split("-")[0]
    # a dead process id, but not judged here: another host (shared file system) and another pid namespace
    elsewhere = [f"shardwise-otherhost-ns{namespace}-pid{dead_pid}-rank0-aaaa", stale[0].replace(
        f"-ns{namespace}-", "-ns1-")]
    for name in elsewhere:
        (nvme / name).mkdir()
    start = time.monotonic()
    seen, _ = run_distributed(_next_job, 2, args=(str(nvme),), timeout=90)
    seconds = time.monotonic() - start
    kept = sorted([live.folder.name, *elsewhere])
    assert not set(stale) & set(seen) and set(kept) <= set(seen), (stale, seen)
    assert sorted(os.listdir(nvme)) == kept, "the next job removed its own folders and only the stale ones"
    assert (live.folder / "master").stat().st_size == 64
    live.remove()
    record_row("death", "NVMe offload: rank 1 killed mid-step; its job's folders stay under `nvme_path`", "2",
               "the next job's set-up on the host removes them; a live process's folder, another host's and another "
               f"pid namespace's are kept (next job, 2 ranks, 1 step: {seconds:.1f} s)", survivor["seconds"])


def test_a_folder_name_says_whose_it_is_and_the_sweep_judges_only_those(tmp_path: Path) -> None:
    """One process: the name round-trips (hyphens in a host name included); names of other programs, of
    another user's layout or of the old format are never swept, whatever their process ids."""
    mine = NvmeFiles(str(tmp_path), 3)
    owner = owner_of(mine.folder.name)
    assert owner is not None and (owner.pid, owner.rank) == (os.getpid(), 3), mine.folder.name
    assert mine.folder.name.startswith(folder_prefix(3))
    assert owner_of("shardwise-gpu-node-7.lan-ns5-pid12-rank0-ab_c1") == Owner("gpu-node-7.lan", 5, 12, 0)
    dead = _a_dead_pid()
    others = [f"shardwise-rank0-pid{dead}-abc", "data", f"shardwise-{owner.host}-ns{owner.namespace}-pid{dead}"]
    for name in others:
        (tmp_path / name).mkdir()
    ours_dead = f"shardwise-{owner.host}-ns{owner.namespace}-pid{dead}-rank1-xyz"
    (tmp_path / ours_dead).mkdir()
    assert sweep(str(tmp_path)) == [ours_dead]
    assert sorted(os.listdir(tmp_path)) == sorted([mine.folder.name, *others])
    mine.remove()


def _a_dead_pid() -> int:
    """The id of a process that has ended (a child, reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


# ---------------------------------------------------------------- two jobs on one nvme_path at once
def _meet(meeting: Path, point: str, job: int) -> None:
    """Wait until both ranks of both jobs reached ``point``."""
    (meeting / f"{point}-{job}-{dist.get_rank()}").touch()
    deadline = time.monotonic() + MEET_S
    while len(list(meeting.glob(f"{point}-*"))) < 4:
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job}: the other job did not reach {point!r} in {MEET_S:g} s")
        time.sleep(0.05)


def _one_of_two_jobs(nvme: str, meeting: str, job: int) -> dict[str, Any]:
    plain = _engine(None)
    offloaded = _engine(nvme)
    _meet(Path(meeting), "built", job)
    folders = sorted(os.listdir(nvme))  # both jobs' ranks, each its own
    for step in range(6):
        for engine in (plain, offloaded):
            train_step(engine, step)
    _meet(Path(meeting), "trained", job)
    assert_close_params(params_of(offloaded.module), params_of(plain.module), atol=ATOL)
    for engine in (plain, offloaded):
        engine.destroy()
    return {"folders": folders}


def test_two_jobs_on_one_nvme_path_at_once_train_as_alone(tmp_path: Path) -> None:
    nvme, meeting = tmp_path / "nvme", tmp_path / "meeting"
    meeting.mkdir()
    results: dict[int, Any] = {}

    def launch(job: int) -> None:
        try:
            results[job] = run_distributed(_one_of_two_jobs, 2, args=(str(nvme), str(meeting), job), timeout=180)
        except BaseException as exc:  # noqa: BLE001 - reported below, with the job
            results[job] = exc

    threads = [threading.Thread(target=launch, args=(job,)) for job in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for job in (0, 1):
        assert not isinstance(results[job], BaseException), f"job {job}: {results[job]}"
        assert len(results[job][0]["folders"]) == 4, results[job]  # 2 jobs x 2 ranks, alive at once
    assert os.listdir(nvme) == []
    record_row("disagree", "NVMe offload: two 2-rank jobs on one `nvme_path` at the same time", "2",
               "each rank of each job keeps its own folder; both train to the weights without offload (atol 1e-6)",
               None)


# ------------------------------------------------------------------ room for every rank of the host
def _two_ranks_on_a_small_disk(nvme: str) -> dict[str, Any]:
    probe = _engine(nvme)
    need = probe.strategy.layout.shard_numel * 12  # fp32 master, AdamW's two moments
    probe.destroy()
    needs: list[Any] = [None, None]
    dist.all_gather_object(needs, need)
    free = max(needs) + min(needs) // 2  # either rank fits alone, the two do not
    real = shutil.disk_usage
    shutil.disk_usage = lambda path: real(path)._replace(free=free)  # type: ignore[assignment]
    try:
        result = outcome(lambda: train_step(_engine(nvme), 0))
    finally:
        shutil.disk_usage = real  # type: ignore[assignment]
    return {**result, "free": free, "needs": needs, "pid": os.getpid()}


def test_the_room_check_counts_every_rank_of_the_host_on_the_disk(tmp_path: Path) -> None:
    results = run_distributed(_two_ranks_on_a_small_disk, 2, args=(str(tmp_path),), timeout=90)
    refused = [r for r in results if r["error"] == "RuntimeError"]
    assert refused, f"both ranks passed the room check: {results}"
    for rank, result in enumerate(results):
        if result["error"] == "RuntimeError":
            message = result["message"]
            assert message.startswith(f"rank {rank}: `zero_optimization.offload_optimizer.nvme_path` "), message
            assert f"has {result['free']:,} bytes free, and the 2 ranks of this host offloading" in message, message
            assert f"rank {rank} (pid {result['pid']}, this rank: fp32 masters" in message, message
            assert f"{result['needs'][rank]:,} still to write" in message, message
            assert "give each rank its own disk" in message, message
        else:  # passed its own check: the fault layer tells it about the refused rank
            assert result["error"] in ("PeerFailedError", "RankGoneError", "CommError"), result
            assert result["seconds"] < 2 * COMMS_TIMEOUT, result
    record_row("misuse", "`offload_optimizer.nvme_path`: each rank fits the disk alone, the host's ranks together "
               "do not", "2", "`RuntimeError` at `initialize` naming each rank's bytes and the free space; a rank "
               "that passed gets the fault layer's error", refused[0]["seconds"])
