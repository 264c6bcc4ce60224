"""ZeRO-Offload's host path on CPU jobs (zero/store/host.py, zero/store/copies.py, zero/offload/shards.py).

Under ``host_path_on_cpu()`` a CPU job takes the path a job on an accelerator takes: ``offload_optimizer: {device:
cpu}`` gets the store's host home and ``nvme`` the NVMe home, both with a gradient buffer and staging buffers
apart from the model's tensors and the copies between them (plain copies here, CUDA copies on a GPU); and
``offload_param: {device: cpu}`` keeps stage 3's shards in host memory (``nvme``: in a file, through host memory)
with a second "device" copy while in use.  So every line of the host path but the CUDA calls runs here.  On 2 ranks,
20 steps with accumulation and clipping: stages 1-3, ``cpu`` and ``nvme``, ``ratio`` 1 and 0.5, and stage 3 with
``offload_param`` ``cpu`` and ``nvme``, train
to the weights of the same stage without offload within 1e-6 (measured: 1.2-2.4e-7 for ``cpu`` and ``nvme``,
which step with torch's fused CPU AdamW where the reference runs its for-loop; 0 with the for-loop); the bytes
copied each way per step are theory's; a script scaling its gradients between backward and step is seen;
checkpoints load into a plain engine and back, and from 2 ranks onto 1.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from _parity import assert_close_params, batch, full_params, make_model, train_steps

import shardwise
from shardwise.testing import distributed_test, run_distributed, run_subtests
from shardwise.zero.offload.files import OffloadIOError
from shardwise.zero.offload.shards import FileShardOnDevice, HostShard, HostShards, ShardCache
from shardwise.zero.store.copies import DeviceCopies
from shardwise.zero.store.host import Host, fused_on_host
from shardwise.zero.store.nvme import Nvme
from shardwise.zero.store.plan import host_path_on_cpu, whole_sub_groups

SUB_GROUP = 300
ATOL = 1e-6


def _config(stage: int, device: Optional[str], ratio: float = 1.0, param: Optional[str] = None, nvme: str = "",
            micro: int = 2) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 500}
    if stage == 3:  # fc1 and head form the persistent unit; embed and fc2 gather on use
        zero.update(stage3_param_persistence_threshold=500, stage3_prefetch_bucket_size=500)
    if device is not None:
        section: dict[str, Any] = {"device": device, "ratio": ratio, "pin_memory": True}
        if device == "nvme":
            section.update(nvme_path=nvme, buffer_count=2)
        zero.update(offload_optimizer=section, sub_group_size=SUB_GROUP)
    if param == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    elif param == "nvme":  # every shard leaves host memory after each use: each use reads the file
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme, "pin_memory": True, "max_in_cpu": 0,
                                 "buffer_count": 2}
    return {"zero_optimization": zero, "gradient_accumulation_steps": micro, "gradient_clipping": 0.1,  # (norms ~0.3: it clips)
            "checkpoint": {"timeout": 30}}


def _engine(stage: int, device: Optional[str], ratio: float = 1.0, param: Optional[str] = None, nvme: str = "",
            micro: int = 2, seed: int = 0) -> Any:
    model = make_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    with host_path_on_cpu():
        return shardwise.initialize(model, optimizer, _config(stage, device, ratio, param, nvme, micro))


def _copies(engine: Any) -> DeviceCopies:
    copies = engine.strategy.store.home.copies
    assert isinstance(copies, DeviceCopies), type(engine.strategy.store.home)
    return copies


def _apart(engine: Any) -> int:
    """Elements of this rank's shard whose state is in host memory (their gradients copied down, values up)."""
    home = engine.strategy.store.home
    return sum(p.numel for p in home.pieces if p.key is not None and home.apart(p))


def _check_apart(engine: Any) -> None:
    """The host path's tensors are apart from the model's: masters, gradients and staging are tensors of their own."""
    store, home = engine.strategy.store, engine.strategy.store.home
    model = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
    for piece in store.pieces:
        if piece.key is None or not home.apart(piece) or not isinstance(home, Host):
            continue
        assert piece.key.untyped_storage().data_ptr() not in model, piece.name
        assert piece.key.grad is not None and piece.key.grad.untyped_storage().data_ptr() == \
            home.copies.grads.untyped_storage().data_ptr(), piece.name


def _parity_case(stage: int, device: str, ratio: float, param: Optional[str], nvme: str,
                 want: dict[str, torch.Tensor]) -> None:
    engine = _engine(stage, device, ratio, param, nvme)
    assert isinstance(engine.strategy.store.home, Host if device == "cpu" else Nvme)
    if param:
        shards = engine.strategy.shards
        assert isinstance(shards, HostShards) and (shards.cache is not None) == (param == "nvme")
        kind = FileShardOnDevice if param == "nvme" else HostShard
        assert all(type(u.storage) is kind for u in engine.strategy.units)
    copies, apart = _copies(engine), _apart(engine)
    assert (0 < apart < engine.strategy.store.home.copies.grads.numel() + 1) if ratio < 1 else apart > 0
    train_steps(engine, 0, 20)
    theory = 20 * apart * 4  # fp32: each element apart goes down (its gradient) and up (its value) once a step
    assert (copies.moved.down, copies.moved.up) == (theory, theory), (copies.moved, theory)
    if param == "nvme":  # the shards came through the file (`max_in_cpu: 0`), read ahead on the cache's thread
        cache = engine.strategy.shards.cache
        assert cache.ahead_hits > 0 and cache.misses > 0 and cache.held_numel() == 0, (cache.ahead_hits, cache.misses)
    got = full_params(engine)
    engine.backward(engine(*batch(40, dist.get_rank())))  # one more accumulation, up to its last step (not taken):
    assert not engine.step()  # the gradients are where that step would read them
    engine.backward(engine(*batch(41, dist.get_rank())))
    _check_apart(engine)
    diff = max((got[k] - want[k]).abs().max().item() for k in want)
    assert diff <= ATOL, f"stage {stage} {device} ratio {ratio} param {param}: max diff {diff:.3g}"
    engine.destroy()


@distributed_test(world_size=2, timeout=600)
def test_the_host_path_trains_like_no_offload(tmp_path: Path) -> None:
    nvme = str(tmp_path / "nvme")
    os.makedirs(nvme, exist_ok=True)
    for stage in (1, 2, 3):
        plain = _engine(stage, None)
        train_steps(plain, 0, 20)
        want = full_params(plain)
        plain.destroy()
        cases = [{"device": device, "ratio": ratio, "param": None} for device in ("cpu", "nvme") for ratio in (1.0, 0.5)]
        if stage == 3:
            cases += [{"device": device, "ratio": ratio, "param": param}
                      for device, ratio, param in (("cpu", 1.0, "cpu"), ("nvme", 0.5, "cpu"), ("cpu", 1.0, "nvme"),
                                                   ("nvme", 0.5, "nvme"))]
        run_subtests(_parity_case, [{"stage": stage, "nvme": nvme, "want": want, **case} for case in cases])
    assert os.listdir(nvme) == [], os.listdir(nvme)


def _scaled_between_backward_and_step(device: Optional[str]) -> dict[str, torch.Tensor]:
    """Stage 1 (its reduced gradients are views of `param.grad`): the script halves them before each step."""
    engine = _engine(1, device, micro=1)
    for step in range(4):
        engine.backward(engine(*batch(step, dist.get_rank())))
        for param in engine.module.parameters():
            param.grad.mul_(0.5)
        engine.step()
    params = full_params(engine)
    engine.destroy()
    return params


def _two_backwards_at_a_boundary(stage: int) -> None:
    """Two backwards at one boundary (DeepSpeed's dialect): the second reduction adds to the first, on the host too
    (stage 3 adds it there; the flat stages add on the device after the copy, which is then copied again)."""
    results = []
    for device in ("cpu", None):
        engine = _engine(stage, device, micro=1)
        engine.accumulates_backwards = True  # (what `shardwise.deepspeed.initialize` sets)
        for step in range(3):
            for half in range(2):
                engine.backward(engine(*batch(2 * step + half, dist.get_rank())))
            engine.step()
        results.append(full_params(engine))
        engine.destroy()
    assert_close_params(results[0], results[1], atol=ATOL)


@distributed_test(world_size=2, timeout=240)
def test_gradients_written_after_their_copy_reach_the_step() -> None:
    assert_close_params(_scaled_between_backward_and_step("cpu"), _scaled_between_backward_and_step(None), atol=ATOL)
    run_subtests(_two_backwards_at_a_boundary, [{"stage": stage} for stage in (2, 3)])


def _round_trip(stage: int, root: str, param: Optional[str]) -> None:
    """Offloaded (ratio 0.5) -> plain and -> offloaded; plain -> offloaded; each continues alike."""
    nvme = str(Path(root) / "nvme")
    os.makedirs(nvme, exist_ok=True)
    offloaded = _engine(stage, "cpu", 0.5, param, nvme)
    train_steps(offloaded, 0, 3)
    offloaded.save_checkpoint(str(Path(root) / "host"), tag="a")
    plain, again = _engine(stage, None, seed=1), _engine(stage, "cpu", 0.5, param, nvme, seed=1)
    for engine in (plain, again):
        engine.load_checkpoint(str(Path(root) / "host"), tag="a")
        assert_close_params(full_params(engine), full_params(offloaded), atol=0.0)
    for engine in (offloaded, plain, again):
        train_steps(engine, 3, 3)
    for engine in (plain, again):  # masters and Adam state carried over exactly (fused against for-loop: 1e-7)
        assert_close_params(full_params(engine), full_params(offloaded), atol=ATOL)
    plain.save_checkpoint(str(Path(root) / "plain"), tag="b")
    back = _engine(stage, "cpu", 1.0, param, nvme, seed=2)
    back.load_checkpoint(str(Path(root) / "plain"), tag="b")
    assert_close_params(full_params(back), full_params(plain), atol=0.0)
    for engine in (back, plain):
        train_steps(engine, 6, 2)
    assert_close_params(full_params(back), full_params(plain), atol=ATOL)
    for engine in (offloaded, plain, again, back):
        engine.destroy()


@distributed_test(world_size=2, timeout=300)
def test_host_checkpoints_load_into_a_plain_engine_and_back(tmp_path: Path) -> None:
    run_subtests(_round_trip, [{"stage": stage, "root": str(tmp_path / f"s{stage}{param}"), "param": param}
                               for stage in (1, 2, 3) for param in (None, "cpu", "nvme") if stage == 3 or not param])


def _save_two(root: str) -> None:
    engine = _engine(3, "cpu", 0.5, "cpu", micro=1)
    train_steps(engine, 0, 3)
    engine.save_checkpoint(str(Path(root) / "two"), tag="t")
    engine.destroy()


def test_a_host_checkpoint_reshards_onto_one_rank(tmp_path: Path) -> None:
    """Saved by 2 offloaded ranks (stage 3, optimizer and parameters in host memory), loaded by 1 rank with and
    without offload: same weights, same next steps."""
    run_distributed(_save_two, 2, args=(str(tmp_path),), timeout=180)
    engines = [_engine(3, "cpu", 1.0, "cpu", micro=1), _engine(3, None, micro=1)]
    for engine in engines:
        engine.load_checkpoint(str(tmp_path / "two"), tag="t")
    assert_close_params(full_params(engines[0]), full_params(engines[1]), atol=0.0)
    for engine in engines:
        train_steps(engine, 3, 2, rank=0)
    assert_close_params(full_params(engines[0]), full_params(engines[1]), atol=ATOL)
    for engine in engines:
        engine.destroy()


# ------------------------------------------------------------ one process
def test_sub_groups_hold_whole_pieces() -> None:
    from shardwise.zero.flat.layout import Piece

    runs = [Piece(i, 0, n, at) for i, (n, at) in enumerate([(100, 0), (250, 100), (700, 350), (50, 1050)])]
    assert whole_sub_groups(runs, 300) == [[0], [1], [2], [3]]
    assert whole_sub_groups(runs, 400) == [[0, 1], [2], [3]]
    assert whole_sub_groups(runs, 10_000) == [[0, 1, 2, 3]]


def test_fused_on_host_uses_the_fused_kernel_only_where_no_kernel_was_asked_for() -> None:
    params = [torch.zeros(3, requires_grad=True)]
    chosen = torch.optim.AdamW(params, foreach=False)
    free = torch.optim.AdamW(params)
    sgd = torch.optim.SGD(params, lr=0.1)
    with fused_on_host(free), fused_on_host(chosen), fused_on_host(sgd):
        assert free.param_groups[0]["fused"] is True
        assert chosen.param_groups[0]["fused"] is None and chosen.param_groups[0]["foreach"] is False
        assert "fused" not in sgd.param_groups[0] or not sgd.param_groups[0]["fused"]
    assert free.param_groups[0]["fused"] is None


def _clipped_step(kernel: dict[str, Any]) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One host step of AdamW (``kernel``: its kernel choice) with the factor 0.25: the ``grad_scale`` and the
    gradient its step saw, the gradient before, and the updated values."""
    from shardwise.zero.store.host import _scaled_in_step
    from shardwise.zero.store.store import Piece

    torch.manual_seed(0)
    key = torch.randn(1000, requires_grad=True)
    key.grad = torch.randn(1000)
    grad = key.grad.clone()
    inner = torch.optim.AdamW([key], lr=0.1, **kernel)
    seen = []
    real = inner.step

    def step() -> Any:
        seen.append((getattr(inner, "grad_scale", None), key.grad.clone()))
        return real()

    inner.step = step  # type: ignore[method-assign]
    with fused_on_host(inner), _scaled_in_step(inner, [Piece(key, "w", key.shape, 0, 1000, 0, 0, 0, key=key)], 0.25):
        inner.step()
    assert not hasattr(inner, "grad_scale")
    (scale, before), = seen
    return scale, before, grad, key.detach().clone()


def test_the_clip_factor_goes_to_the_fused_kernel_else_a_pass_of_its_own() -> None:
    """The host step's unscale-and-clip: torch's ``grad_scale`` where every group runs the fused kernel (no pass
    over the gradients before the step), a multiply first otherwise; the same update within a float rounding."""
    scale, before, grad, fused = _clipped_step({})
    assert scale is not None and scale.item() == 4.0 and torch.equal(before, grad)
    scale, before, grad, loop = _clipped_step({"foreach": False})
    assert scale is None and torch.equal(before, grad * 0.25)
    assert torch.allclose(fused, loop, rtol=0, atol=1e-6)


class _Unit:
    shard_busy = False


def test_a_host_shard_copies_up_on_use_and_writes_back_only_what_was_written() -> None:
    shards = HostShards(torch.device("cpu"), pin=True)  # (no pinning without CUDA)
    device_shard = torch.arange(6, dtype=torch.float32)
    unit = _Unit()
    shard = shards.place(device_shard, unit)
    assert shard.copy is device_shard and shard.home.data_ptr() != device_shard.data_ptr()
    shard.released()
    assert shard.copy is None and shard.held_bytes() == 0 and shards.down == 0  # unwritten: nothing written back
    used = shard.get()
    assert torch.equal(used, torch.arange(6.0)) and used.data_ptr() != shard.home.data_ptr() and shards.up == 24
    used.mul_(2)
    unit.shard_busy = True
    shard.released()
    assert shard.copy is used  # an all-gather reads it: it stays
    unit.shard_busy = False
    shard.released()
    assert shard.copy is None and torch.equal(shard.home, torch.arange(6.0) * 2) and shards.down == 24
    shard.write([(1, torch.tensor([7.0, 8.0]))])  # no device copy: straight into host memory
    assert torch.equal(shard.home[:4], torch.tensor([0.0, 7.0, 8.0, 6.0]))
    shard.read_ahead()
    assert shard.pending is not None and shard.held_bytes() == 24
    shard.write([(0, torch.tensor([9.0]))])  # a copy ahead would miss it: dropped
    assert shard.pending is None
    shard.read_ahead()
    assert torch.equal(shard.get()[:2], torch.tensor([9.0, 7.0])) and shard.pending is None
    with pytest.raises(RuntimeError, match="cannot become a torch.float16 tensor"):
        shard.put(torch.zeros(6, dtype=torch.float16))


class _FileUnit(_Unit):
    label = "`fc.weight`"


def test_a_shard_in_a_file_comes_up_in_two_reads_ahead_and_goes_back_into_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`offload_param: nvme` on an accelerator: the file, its host copy (none kept: `max_in_cpu` 0) and the device
    copy (a second host tensor here)."""
    cache = ShardCache(str(tmp_path), 0, 6, torch.float32, max_in_cpu=0, ahead=2)
    shards = HostShards(torch.device("cpu"), pin=True, cache=cache)
    shard = shards.place(torch.arange(6, dtype=torch.float32), _FileUnit())
    assert isinstance(shard, FileShardOnDevice)
    shard.released()
    assert shard.copy is None and shard.home.tensor is None and shards.down == 0  # only in the file now
    shard.read_ahead()  # the file into host memory, on the cache's thread
    assert shard.pending is None and shard.home.pending is not None
    shard.home.pending.result()
    shard.read_ahead()  # a later call of the window: copied up
    assert shard.pending is not None and cache.ahead_hits == 1
    used = shard.get()
    assert torch.equal(used, torch.arange(6.0)) and shard.pending is None and shards.up == 24
    used.mul_(2)
    shard.released()  # written: into the file (its host copy had left), nothing read for it
    assert shard.copy is None and shard.home.tensor is None and shards.down == 24 and cache.misses == 0
    shard.write([(1, torch.tensor([7.0, 8.0]))])  # no copy anywhere: into the file
    assert torch.equal(shard.get(), torch.tensor([0.0, 7.0, 8.0, 6.0, 8.0, 10.0])) and cache.misses == 1
    shard.released()

    def broken(*args: Any, **kwargs: Any) -> None:
        raise OffloadIOError("reading failed", rank=0, path="params", operation="reading", error=5)

    monkeypatch.setattr(cache.files, "read_into", broken)
    shard.read_ahead()
    shard.home.pending.exception()  # (waits)
    shard.read_ahead()  # a failed read ahead is not copied up, nor raised here: by the use that needs it
    assert shard.pending is None
    with pytest.raises(OffloadIOError, match="The read ahead was dropped"):
        shard.get()
    monkeypatch.undo()
    assert torch.equal(shard.get(), torch.tensor([0.0, 7.0, 8.0, 6.0, 8.0, 10.0]))
    shards.close()
    assert not os.listdir(tmp_path)


def test_staging_casts_into_the_compute_dtype_in_batches() -> None:
    copies = DeviceCopies(torch.device("cpu"), torch.bfloat16, pin=False)
    written: list[tuple[str, int, torch.Tensor]] = []
    values = torch.randn(7)
    copies.publish(lambda runs: written.extend((p, at, v.clone()) for p, at, v in runs),
                   [("a", 0, values[:3]), ("b", 2, values[3:])])
    assert [(p, at, v.dtype) for p, at, v in written] == [("a", 0, torch.bfloat16), ("b", 2, torch.bfloat16)]
    assert torch.equal(torch.cat([v for _, _, v in written]), values.to(torch.bfloat16))
    assert copies.moved.up == 14


def test_the_gpu_benchmark_runs_its_tiny_version_on_the_cpu(tmp_path: Path) -> None:
    """`python -m benchmarks.offload --device cpu`: the GPU benchmark's program at a tiny size, each try a process of
    its own; the bytes it reports copied per step are theory's (4 bytes an element down, 2 up in bf16)."""
    from benchmarks.offload import main

    main(["--device", "cpu", "--settings", "cpu+param,nvme+param", "--layers", "1", "--nvme", str(tmp_path / "nvme"),
          "--out", str(tmp_path)])
    results = json.loads((tmp_path / "offload_gpu.json").read_text())
    assert min(results["bandwidth_gbs"].values()) > 0
    assert [t["spec"]["setting"] for t in results["capacity"]] == ["cpu+param", "nvme+param"], results["capacity"]
    for tried in results["capacity"]:
        assert tried["result"] == "trains" and len(tried["step_s"]) == 2, tried
    runs = {r["spec"]["setting"]: r for r in results["speed"]}
    assert set(runs) == {"none", "cpu"} and all(r["result"] == "trains" for r in runs.values()), runs
    cpu = runs["cpu"]
    assert cpu["apart"] == cpu["numel"] and cpu["down_per_step"] == 4 * cpu["apart"], cpu
    assert cpu["up_per_step"] == 2 * cpu["apart"], cpu
    assert runs["none"]["down_per_step"] == runs["none"]["up_per_step"] == 0
