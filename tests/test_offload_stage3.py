"""ZeRO-Infinity at stage 3 (docs/offload.md): optimizer state and parameter shards on NVMe.

Same math: over 20 steps on 2 ranks, with accumulation and clipping, a stage 3 engine with
`offload_optimizer: nvme`, with `offload_param: nvme`, and with both, trains to the weights stage 3
trains without offload (fp32 and bf16, atol 1e-6: the step is torch's own over the same fp32 masters, so
they agree to the bit here).  Its checkpoints load into a plain stage 3 engine and back, and reshard
from 2 ranks to 1; a parameter frozen mid-run (or at initialize) and thawed carries its master and
state; a `zero.Init`-built model, writes through `GatheredParameters` and `zero.load_state_dict` train as
without offload;
every offload folder is gone after `destroy`.  With `max_in_cpu: 0` no shard stays in host memory
between uses.
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
from shardwise.zero.store.nvme import Nvme

#: small enough that this rank's pieces span several sub-groups, the embedding's cut across them
SUB_GROUP = 300
ATOL = 1e-6


def _config(nvme: Optional[str], what: str, micro: int = 2, bf16: bool = False) -> dict[str, Any]:
    # fc1 and head (408 and 200 elements) form the persistent unit, always gathered; embed and fc2 gather on use
    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 500,
                            "stage3_prefetch_bucket_size": 500}
    if nvme is not None and what in ("optimizer", "both"):
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": 2}
        zero["sub_group_size"] = SUB_GROUP
    if nvme is not None and what in ("param", "both"):
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": 2, "max_in_cpu": 0}
    return {"zero_optimization": zero, "gradient_accumulation_steps": micro, "gradient_clipping": 0.5,
            "checkpoint": {"timeout": 30}, "bf16": {"enabled": bf16}}


def _engine(nvme: Optional[str], what: str = "both", micro: int = 2, bf16: bool = False) -> Any:
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return shardwise.initialize(model, optimizer, _config(nvme, what, micro, bf16))


def _folders(engine: Any) -> list[Path]:
    strategy = engine.strategy
    found = [] if strategy.shards is None else [strategy.shards.files.folder]
    home = strategy.store.home
    if isinstance(home, Nvme) and home.files is not None:
        found.append(home.files.folder)
    return found


def _parity_case(nvme: str, what: str, bf16: bool = False) -> None:
    plain = _engine(None, bf16=bf16)
    train_steps(plain, 0, 20)
    offloaded = _engine(nvme, what, bf16=bf16)
    folders = _folders(offloaded)
    assert len(folders) == (2 if what == "both" else 1), folders
    train_steps(offloaded, 0, 20)
    assert_close_params(full_params(offloaded), full_params(plain), atol=ATOL)
    assert not offloaded.optimizer.inner.state or what == "param", "optimizer state stays on disk between steps"
    if what != "optimizer":  # max_in_cpu 0: no shard stays in host memory between uses, only gathered units
        gathered = sum(u.padded * u.element_bytes() for u in offloaded.strategy.units if u.persistent)
        assert gathered > 0 and offloaded.memory_breakdown()["parameters"] == gathered, offloaded.memory_breakdown()
        shards = offloaded.strategy.shards
        assert shards.files.bytes_read > 0 and shards.files.bytes_written > 0
        assert shards.ahead_hits > 0, "the gatherer's prefetch read shards ahead"
    if what != "param":
        groups = offloaded.strategy.store.home.stepper.groups
        assert len(groups) >= 3 and max(g.numel for g in groups) <= SUB_GROUP
    offloaded.destroy()
    plain.destroy()
    assert not any(folder.exists() for folder in folders), f"{folders} left after destroy"


@distributed_test(world_size=2, timeout=240)
def test_stage3_nvme_offload_trains_as_stage3_without_it(tmp_path: Path) -> None:
    nvme = str(tmp_path)
    cases = [{"nvme": nvme, "what": "optimizer"}, {"nvme": nvme, "what": "param"}, {"nvme": nvme, "what": "both"},
             {"nvme": nvme, "what": "both", "bf16": True}]  # bf16: fp32 masters on disk, bf16 shards too
    run_subtests(_parity_case, cases)
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


def _round_trip(root: str) -> None:
    """Offloaded -> plain -> offloaded, each continuing where the other stopped."""
    nvme = str(Path(root) / "nvme")
    first = _engine(nvme)
    train_steps(first, 0, 3)
    first.save_checkpoint(str(Path(root) / "offloaded"), tag="a")
    plain = _engine(None)
    plain.load_checkpoint(str(Path(root) / "offloaded"), tag="a")
    assert_close_params(full_params(plain), full_params(first), atol=0.0)
    for engine in (first, plain):
        train_steps(engine, 3, 3)
    assert_close_params(full_params(plain), full_params(first), atol=ATOL)  # masters and Adam state carried over exactly
    plain.save_checkpoint(str(Path(root) / "plain"), tag="b")
    back = _engine(nvme)
    back.load_checkpoint(str(Path(root) / "plain"), tag="b")
    for engine in (back, plain):
        train_steps(engine, 6, 3)
    assert_close_params(full_params(back), full_params(plain), atol=ATOL)
    full, want = back.full_state_dict(), full_params(plain)  # the consolidated weights read the shards' files too
    if dist.get_rank() == 0:
        assert_close_params({k: v.float() for k, v in full.items()}, want, atol=ATOL)
    for engine in (first, plain, back):
        engine.destroy()
    dist.barrier()
    assert os.listdir(nvme) == [], os.listdir(nvme)


def _modified(nvme: Optional[str]) -> dict[str, torch.Tensor]:
    engine = _engine(nvme, micro=1)
    train_steps(engine, 0, 2)
    for param in (engine.module.embed.weight, engine.module.head.bias):  # a gathered-on-use and a persistent unit
        with shardwise.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
            if dist.get_rank() == 0:
                param.mul_(0.5)
    train_steps(engine, 2, 2)
    shardwise.zero.load_state_dict(engine.module, make_model(seed=1).state_dict())  # unit by unit, into the files
    train_steps(engine, 4, 2)
    params = full_params(engine)
    engine.destroy()
    return params


def _modifying(root: str) -> None:
    """Values written through ``GatheredParameters(modifier_rank=0)`` or ``zero.load_state_dict`` reach the
    shards' file and the masters' file."""
    assert_close_params(_modified(str(Path(root) / "nvme")), _modified(None), atol=ATOL)


def _freeze_and_thaw(nvme: Optional[str], frozen_at_start: bool) -> dict[str, torch.Tensor]:
    """fc1.weight stops training at step 3 and trains again at step 6, its master and Adam state carried
    (or, ``frozen_at_start``, is frozen at initialize and starts training at step 3 from its shard)."""
    model = make_model()
    model.fc1.weight.requires_grad_(not frozen_at_start)
    engine = shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
                                  _config(nvme, "both", micro=1))
    for step in range(9):
        if step in (3, 6):
            engine.module.fc1.weight.requires_grad_(step == 6 or frozen_at_start)
        train_steps(engine, step, 1)
    params = full_params(engine)
    engine.destroy()
    return params


def _freezing(root: str, frozen_at_start: bool) -> None:
    got = _freeze_and_thaw(str(Path(root) / "nvme"), frozen_at_start)
    assert_close_params(got, _freeze_and_thaw(None, frozen_at_start), atol=ATOL)


def _built_partitioned(nvme: Optional[str]) -> dict[str, torch.Tensor]:
    config = _config(nvme, "both")
    torch.manual_seed(0)
    with shardwise.zero.Init(config=config):
        model = make_model()
    engine = shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), config)
    train_steps(engine, 0, 4)
    params = full_params(engine)
    engine.destroy()
    return params


def _zero_init(root: str) -> None:
    """A model built by ``zero.Init`` trains offloaded as it trains without offload."""
    assert_close_params(_built_partitioned(str(Path(root) / "nvme")), _built_partitioned(None), atol=ATOL)


@distributed_test(world_size=2, timeout=240)
def test_stage3_offload_checkpoints_freezing_and_zero_init(
        tmp_path: Path) -> None:
    run_subtests(_round_trip, [{"root": str(tmp_path / "trip")}])
    run_subtests(_freezing, [{"root": str(tmp_path / "freeze"), "frozen_at_start": False},
                             {"root": str(tmp_path / "thaw"), "frozen_at_start": True}])
    run_subtests(_zero_init, [{"root": str(tmp_path / "init")}])
    run_subtests(_modifying, [{"root": str(tmp_path / "modify")}])
    places = ("trip", "freeze", "thaw", "init", "modify")
    assert [os.listdir(tmp_path / where / "nvme") for where in places] == [[]] * len(places)


def test_offload_param_nvme_is_accepted_at_stage_3_of_cpu_and_gpu_jobs() -> None:
    section = {"device": "nvme", "nvme_path": "/tmp/x", "max_in_cpu": 10, "buffer_size": 5, "pipeline_read": True}
    config = Config.load({"zero_optimization": {"stage": 3, "offload_param": section}}).resolve(device="cpu")
    param = config.zero_optimization.offload_param
    assert param is not None and param.device == "nvme" and param.max_in_cpu == 10
    assert any("`buffer_size`, `pipeline_read` ignored" in note.message for note in config.notes)
    with pytest.raises(ConfigError, match="needs ZeRO stage 3, and this is stage 2"):
        Config.load({"zero_optimization": {"stage": 2, "offload_param": section}}).resolve(device="cpu")
    gpu = Config.load({"zero_optimization": {"stage": 3, "offload_param": section}}).resolve(device="cuda")
    assert any("copied to cuda as the unit is gathered" in note.message for note in gpu.notes)


def test_offload_param_cpu_on_a_cpu_job_is_an_info_line_about_the_parameters() -> None:
    config = Config.load({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}).resolve(device="cpu")
    notes = [n.message for n in config.notes if n.path == "zero_optimization.offload_param"]
    assert any("holds already" in n and "where the parameters already are" in n for n in notes), notes


def _save_offloaded(root: str) -> None:
    engine = _engine(str(Path(root) / "nvme"), micro=1)
    train_steps(engine, 0, 3)
    engine.save_checkpoint(str(Path(root) / "two"), tag="t")
    engine.destroy()


def test_a_stage3_offloaded_checkpoint_reshards_onto_one_rank(tmp_path: Path) -> None:
    """Saved by 2 offloaded ranks, loaded by 1 rank with and without offload: same weights, same next steps."""
    run_distributed(_save_offloaded, 2, args=(str(tmp_path),), timeout=180)
    engines = [_engine(str(tmp_path / "nvme1"), micro=1), _engine(None, micro=1)]
    for engine in engines:
        engine.load_checkpoint(str(tmp_path / "two"), tag="t")
    assert_close_params(full_params(engines[0]), full_params(engines[1]), atol=0.0)
    for engine in engines:
        train_steps(engine, 3, 2)
    assert_close_params(full_params(engines[0]), full_params(engines[1]), atol=ATOL)
    for engine in engines:
        engine.destroy()
    assert list((tmp_path / "nvme1").iterdir()) == []


def _moved_per_step(nvme: str) -> dict[str, Any]:
    return {what: measure(2, 2, nvme, 262_144, 4, stage=3, what=what) for what in ("optimizer", "param", "both")}


def test_bytes_moved_per_step_equal_theory(tmp_path: Path) -> None:
    """`benchmarks.offload` at stage 3: per step, the optimizer's 12 bytes an element read and written once,
    a shard's 4 bytes read twice (the forward's gather, the backward's) and written once (the step, unread)."""
    for rank in run_distributed(_moved_per_step, 2, args=(str(tmp_path),), timeout=180):
        for what, figures in rank.items():
            moved = (figures["read_per_step"], figures["written_per_step"])
            assert moved == figures["theory"] and figures["shard"] == 1_001_000, (what, moved, figures["theory"])
    assert list(tmp_path.iterdir()) == []
