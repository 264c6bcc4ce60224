"""Every config field is read (issue 35): changing it changes something observable, or it is a setting
whose other values only earn an info line (or are refused).

The test walks every field of every section of `shardwise.Config` and requires that each is covered
here: a probe that builds engines with two values of the field and observes something that differs
(the weights after a step, a loss scale, the files a save writes, a component the field configures),
or an entry saying why its other value changes nothing on this job (with the info line it earns), or
that only its default is accepted. A new field that nobody reads fails `test_every_field_is_covered`.
Before issue 35, `optimizer.deepspeed_start` was accepted and read nowhere.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from _log_capture import logged
from torch import nn
from torch.utils.data import TensorDataset

import shardwise
import shardwise.deepspeed as deepspeed
from shardwise.config import Config, ConfigError
from shardwise.config.sections import section_of
from shardwise.testing import distributed_test

SGD = {"type": "SGD", "params": {"lr": 0.1}}


def _fields(model: Any = Config, prefix: str = "") -> list[str]:
    found = []
    for name, info in model.model_fields.items():
        sub = section_of(info.annotation)
        found += _fields(sub, f"{prefix}{name}.") if sub is not None else [f"{prefix}{name}"]
    return found


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _engine(cfg: dict[str, Any]) -> Any:
    return shardwise.initialize(_model(), config={"optimizer": SGD, **cfg})


def _step(engine: Any, scale: float = 1.0) -> None:
    x = torch.linspace(-1, 1, 8).reshape(2, 4)
    out = engine(x.to(torch.float16) if engine.fp16_enabled() else x)
    engine.backward(out.float().pow(2).mean() * scale)
    engine.step()


def _weights_after(cfg: dict[str, Any], scale: float = 1.0) -> list[float]:
    engine = _engine(cfg)
    _step(engine, scale)
    values = [round(float(v), 6) for v in engine.module[0].weight.detach().float().reshape(-1)[:4]]
    engine.destroy()
    return values


def _of(cfg: dict[str, Any], read: Callable[[Any], Any], steps: int = 0, scale: float = 1.0) -> Any:
    engine = _engine(cfg)
    for _ in range(steps):
        _step(engine, scale)
    value = read(engine)
    engine.destroy()
    return value


def _scale_after(cfg: dict[str, Any], scales: list[float]) -> float:
    engine = _engine({"fp16": {"enabled": True, **cfg}})
    for scale in scales:  # inf: an overflowing step
        _step(engine, scale)
    value = float(engine.loss_scale)
    engine.destroy()
    return value


def _accumulated(cfg: dict[str, Any]) -> int:
    engine = _engine(cfg)
    for _ in range(2):
        _step(engine)
    value = int(engine.global_steps)
    engine.destroy()
    return value


def _saved_files(cfg: dict[str, Any], folder: Path, client_state: Any = None) -> Any:
    engine = _engine(cfg)
    _step(engine)
    try:
        tag = Path(engine.save_checkpoint(folder, client_state=client_state))
    except Exception as exc:  # noqa: BLE001 - the outcome is what the probe observes
        return type(exc).__name__
    finally:
        engine.destroy()
    return sorted(p.name for p in tag.iterdir())


def _rank_file_keys(cfg: dict[str, Any], folder: Path) -> list[str]:
    engine = _engine(cfg)
    _step(engine)
    tag = Path(engine.save_checkpoint(folder))
    engine.destroy()
    return sorted(json.loads((tag / "rank0.json").read_text()))


def _agreement_timeout(cfg: dict[str, Any], folder: Path, monkeypatch: Any) -> float:
    import shardwise.checkpoint.save as save

    seen: list[float] = []
    real = save.join
    monkeypatch.setattr(save, "join", lambda comm, op, payload, timeout: seen.append(timeout) or real(
        comm, op, payload, timeout))
    _saved_files(cfg, folder)
    monkeypatch.setattr(save, "join", real)
    return seen[0]


def _logged(cfg: dict[str, Any]) -> list[str]:
    with logged() as records:
        engine = _engine(cfg)
        _step(engine)
        engine.destroy()
    return [r.split(":")[0] + ("+timings" if "forward=" in r else "") for r in records if r.startswith("step ")]


def _stale_after_freezing(cfg: dict[str, Any]) -> bool:
    """Whether the engine still works with the trainable set of before a parameter was frozen."""
    engine = _engine(cfg)
    engine.module[0].weight.requires_grad_(False)  # frozen after initialize
    _step(engine)
    stale = bool(engine.strategy.trainable_changed())
    engine.destroy()
    return stale


def _rng_after(cfg: dict[str, Any]) -> float:
    engine = _engine(cfg)
    value = float(torch.rand(1))
    engine.destroy()
    return value


def _group_timeout(cfg: dict[str, Any]) -> float:
    # The process group `initialize` creates when none exists: leave the harness's first.
    dist.destroy_process_group()
    engine = _engine(cfg)
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    seconds = backend.options._timeout.total_seconds()
    engine.destroy()
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60))
    return float(seconds)


def _batches(cfg: dict[str, Any]) -> int:
    model = _model()
    data = TensorDataset(torch.randn(5, 4))
    engine, _, loader, _ = deepspeed.initialize(model=model, training_data=data,
                                                config={"train_micro_batch_size_per_gpu": 2, "optimizer": SGD,
                                                        **cfg})
    count = len(loader)
    engine.destroy()
    return count


def _nvme(kind: str, folder: Path, stage: int, **section: Any) -> dict[str, Any]:
    return {"zero_optimization": {"stage": stage, kind: {"device": "nvme", "nvme_path": str(folder), **section},
                                  "stage3_param_persistence_threshold": 0}}


def _files_under(cfg: dict[str, Any], folder: Path) -> bool:
    engine = _engine(cfg)
    _step(engine)
    found = any(p.is_file() for p in folder.rglob("*"))
    engine.destroy()
    return found


Probe = Callable[[Any, Path, Any], Any]
#: field -> (observe with value a, observe with value b): the two must differ
PROBES: dict[str, tuple[Probe, Probe]] = {}


def probe(field: str, observe: Callable[[Any, Path, Any], Any], a: Any, b: Any) -> None:
    PROBES[field] = (lambda tmp, mp, v=a: observe(v, tmp, mp), lambda tmp, mp, v=b: observe(v, tmp, mp))


probe("train_batch_size", lambda v, t, m: _of({"train_batch_size": v, "train_micro_batch_size_per_gpu": 2},
                                               lambda e: e.gradient_accumulation_steps()), 2, 4)
probe("train_micro_batch_size_per_gpu", lambda v, t, m: _of(
    {"train_batch_size": 4, "train_micro_batch_size_per_gpu": v}, lambda e: e.gradient_accumulation_steps()), 1, 2)
probe("gradient_accumulation_steps", lambda v, t, m: _accumulated({"gradient_accumulation_steps": v}), 1, 2)
probe("gradient_clipping", lambda v, t, m: _weights_after({"gradient_clipping": v}, scale=100.0), 0.0, 0.01)
probe("optimizer.type", lambda v, t, m: _of({"optimizer": {"type": v}}, lambda e: type(e.optimizer.inner).__name__),
      "SGD", "Adagrad")
probe("optimizer.params", lambda v, t, m: _weights_after({"optimizer": {"type": "SGD", "params": v}}),
      {"lr": 0.1}, {"lr": 0.2})
probe("scheduler.type", lambda v, t, m: _of({"scheduler": {"type": v, "params": {"total_num_steps": 10, "warmup_num_steps": 2}}},
                                            lambda e: e.get_lr(), steps=2), "WarmupDecayLR", "WarmupCosineLR")
probe("scheduler.params", lambda v, t, m: _of({"scheduler": {"type": "WarmupLR", "params": v}},
                                              lambda e: e.get_lr(), steps=2), {"warmup_max_lr": 0.1},
      {"warmup_max_lr": 0.2})
probe("scheduler.deepspeed_start", lambda v, t, m: _of(
    {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}, "deepspeed_start": v}},
    lambda e: e.get_lr(), steps=1), False, True)
probe("fp16.enabled", lambda v, t, m: _of({"fp16": {"enabled": v}}, lambda e: e.fp16_enabled()), False, True)
probe("fp16.loss_scale", lambda v, t, m: _scale_after({"loss_scale": v}, []), 0, 8)
probe("fp16.initial_scale_power", lambda v, t, m: _scale_after({"initial_scale_power": v}, []), 4, 6)
probe("fp16.loss_scale_window", lambda v, t, m: _scale_after({"initial_scale_power": 4, "loss_scale_window": v},
                                                             [1.0, 1.0]), 1, 1000)
probe("fp16.hysteresis", lambda v, t, m: _scale_after({"initial_scale_power": 4, "hysteresis": v},
                                                      [float("inf")]), 1, 2)
probe("fp16.min_loss_scale", lambda v, t, m: _scale_after({"initial_scale_power": 0, "hysteresis": 1,
                                                           "min_loss_scale": v}, [float("inf")]), 1.0, 0.25)
probe("fp16.consecutive_hysteresis", lambda v, t, m: _scale_after(
    {"initial_scale_power": 4, "hysteresis": 2, "loss_scale_window": 1000, "consecutive_hysteresis": v},
    [float("inf"), 1.0, float("inf")]), False, True)
probe("bf16.enabled", lambda v, t, m: _of({"bf16": {"enabled": v}}, lambda e: e.bfloat16_enabled()), False, True)
probe("zero_optimization.stage", lambda v, t, m: _of({"zero_optimization": {"stage": v}},
                                                     lambda e: type(e.strategy).__name__), 0, 3)
probe("zero_optimization.reduce_bucket_size", lambda v, t, m: _of(
    {"zero_optimization": {"stage": 1, "reduce_bucket_size": v}}, lambda e: len(e.strategy.layout.buckets)), 1, 10**6)
probe("zero_optimization.reduce_scatter", lambda v, t, m: _of(
    {"zero_optimization": {"stage": 1, "reduce_scatter": v}}, lambda e: e.strategy.reduce_scatter), False, True)
# stage 3's gather schedule: what the gatherer that prefetches and releases units works with
probe("zero_optimization.stage3_prefetch_bucket_size", lambda v, t, m: _of(
    {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": v}}, lambda e: e.strategy.gatherer.prefetch_numel),
      0, 100)
probe("zero_optimization.stage3_max_live_parameters", lambda v, t, m: _of(
    {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": v}}, lambda e: e.strategy.gatherer.max_live),
      0, 100)
probe("zero_optimization.stage3_max_reuse_distance", lambda v, t, m: _of(
    {"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": v}}, lambda e: e.strategy.gatherer.reuse_distance),
      0, 100)
probe("zero_optimization.stage3_param_persistence_threshold", lambda v, t, m: _of(
    {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": v}},
    lambda e: [u.persistent for u in e.strategy.units]), 0, 100)
probe("zero_optimization.stage3_gather_16bit_weights_on_model_save", lambda v, t, m: _saved_files(
    {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": v}}, t / str(v)), False, True)
probe("zero_optimization.sub_group_size", lambda v, t, m: _of(
    {**_nvme("offload_optimizer", t / str(v), 1), "zero_optimization": {
        **_nvme("offload_optimizer", t / str(v), 1)["zero_optimization"], "sub_group_size": v}},
    lambda e: len(e.strategy.store.home.stepper.groups)), 10, 10**6)
probe("zero_optimization.offload_optimizer.device", lambda v, t, m: _of(
    {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": v, "nvme_path": str(t)}}},
    lambda e: type(e.strategy.store.home).__name__), "cpu", "nvme")
probe("zero_optimization.offload_optimizer.nvme_path", lambda v, t, m: _files_under(
    _nvme("offload_optimizer", t / "here", 1), t / v), "elsewhere", "here")
probe("zero_optimization.offload_optimizer.buffer_count", lambda v, t, m: _of(
    {"zero_optimization": {**_nvme("offload_optimizer", t / str(v), 1, buffer_count=v)["zero_optimization"],
                           "sub_group_size": 10}}, lambda e: e.strategy.store.home.pool.count), 1, 3)
probe("zero_optimization.offload_optimizer.ratio", lambda v, t, m: _of(
    {"zero_optimization": {**_nvme("offload_optimizer", t / str(v), 1, ratio=v)["zero_optimization"],
                           "sub_group_size": 10}}, lambda e: e.strategy.store.home.resident), 1.0, 0.5)
probe("zero_optimization.offload_param.device", lambda v, t, m: _of(
    {"zero_optimization": {"stage": 3, "offload_param": {"device": v, "nvme_path": str(t)}}},
    lambda e: e.strategy.shards is None), "cpu", "nvme")
probe("zero_optimization.offload_param.nvme_path", lambda v, t, m: _files_under(
    _nvme("offload_param", t / "here", 3), t / v), "elsewhere", "here")
probe("zero_optimization.offload_param.buffer_count", lambda v, t, m: _of(
    _nvme("offload_param", t / str(v), 3, buffer_count=v), lambda e: e.strategy.shards.ahead), 1, 3)
probe("zero_optimization.offload_param.max_in_cpu", lambda v, t, m: _of(
    _nvme("offload_param", t / str(v), 3, max_in_cpu=v), lambda e: e.strategy.shards.max_in_cpu), 0, 100)
probe("checkpoint.timeout", lambda v, t, m: _agreement_timeout({"checkpoint": {"timeout": v}}, t / str(v), m), 5, 7)
probe("checkpoint.save_rng_state", lambda v, t, m: _rank_file_keys({"checkpoint": {"save_rng_state": v}},
                                                                   t / str(v)), False, True)
probe("checkpoint.allow_pickle", lambda v, t, m: _saved_files({"checkpoint": {"allow_pickle": v}}, t / str(v),
                                                              client_state={"when": timedelta(1)}), False, True)
probe("comms.timeout", lambda v, t, m: _of({"comms": {"timeout": v}}, lambda e: e.comm.timeout), 5, 7)
probe("comms.debug", lambda v, t, m: _of({"comms": {"debug": v}}, lambda e: e.comm.debug), False, True)
probe("auto_refresh_trainable", lambda v, t, m: _stale_after_freezing({"auto_refresh_trainable": v}), False, True)
probe("steps_per_print", lambda v, t, m: _logged({"steps_per_print": v}), 1, 1000)
probe("wall_clock_breakdown", lambda v, t, m: _logged({"wall_clock_breakdown": v, "steps_per_print": 1}), False,
      True)
probe("seed", lambda v, t, m: _rng_after({"seed": v}), 1, 2)
probe("dist_timeout", lambda v, t, m: _group_timeout({"dist_timeout": v}), 50, 70)
probe("communication_data_type", lambda v, t, m: _of({"communication_data_type": v},
                                                     lambda e: e.precision.reduce_dtype), "fp32", "bf16")
probe("dataloader_drop_last", lambda v, t, m: _batches({"dataloader_drop_last": v}), False, True)

#: fields whose effect needs several ranks: observed in `test_multi_rank_fields_are_read`
MULTI_RANK = {"comms.shared_memory": "collectives go through /dev/shm between the ranks of one host",
              "broadcast_buffers": "rank 0's buffers reach the other ranks before a forward"}
#: fields whose other values change nothing on a CPU job: (a config with the other value, its info line)
NOTED = {
    "zero_optimization.offload_optimizer.pin_memory": (
        {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": True}}},
        "`zero_optimization.offload_optimizer.pin_memory` changes nothing on a CPU job"),
    "zero_optimization.offload_param.pin_memory": (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}},
        "`zero_optimization.offload_param.pin_memory` changes nothing on a CPU job"),
}
#: fields that accept only their default; any other value is refused, naming the feature
ONLY_DEFAULT = {"checkpoint.async_save": ({"checkpoint": {"async_save": True}}, "written in the background")}


def test_every_field_is_covered() -> None:
    covered = set(PROBES) | set(MULTI_RANK) | set(NOTED) | set(ONLY_DEFAULT)
    fields = set(_fields())
    assert fields - covered == set(), f"fields nothing here shows to be read: {sorted(fields - covered)}"
    assert covered - fields == set(), f"entries for fields that do not exist: {sorted(covered - fields)}"


@distributed_test(world_size=1, timeout=300)
def test_changing_a_field_changes_what_it_governs(tmp_path: Path) -> None:
    failures = {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        for field, (first, second) in PROBES.items():
            try:
                a, b = first(tmp_path / field / "a", monkeypatch), second(tmp_path / field / "b", monkeypatch)
            except Exception as exc:  # noqa: BLE001 - every field's outcome is reported together
                failures[field] = f"{type(exc).__name__}: {exc!s:.300}"
                continue
            if a == b:
                failures[field] = f"both values gave {a!r}"
    assert not failures, failures


@pytest.mark.parametrize("field", sorted(NOTED))
def test_a_field_that_changes_nothing_here_says_so(field: str) -> None:
    config, line = NOTED[field]
    notes = Config.load(config).resolve(device="cpu").notes  # on a job on an accelerator it pins the host buffers
    assert any(line in note.message for note in notes), notes


@pytest.mark.parametrize("field", sorted(ONLY_DEFAULT))
def test_a_field_that_takes_only_its_default_refuses_the_rest(field: str) -> None:
    config, words = ONLY_DEFAULT[field]
    with pytest.raises(ConfigError, match=words):
        Config.load(config)


@distributed_test(world_size=2, timeout=120)
def test_multi_rank_fields_are_read() -> None:
    rank = dist.get_rank()
    shm = {v: _of({"comms": {"shared_memory": v}}, lambda e: e.comm.shm.active) for v in (False, True)}
    assert shm == {False: False, True: True}, shm
    for broadcast in (False, True):
        model = _model()
        model.register_buffer("count", torch.zeros(1))
        engine = shardwise.initialize(model, config={"optimizer": SGD, "broadcast_buffers": broadcast})
        engine.module.count.fill_(rank)  # the ranks' buffers drift apart (BatchNorm statistics do)
        engine(torch.ones(2, 4))
        assert float(engine.module.count) == (0.0 if broadcast else float(rank)), (broadcast, rank)
        engine.destroy()
