"""Offload as DeepSpeed users bring it (docs/offload.md, "From DeepSpeed"), on 2 gloo ranks.

* Config files in the style of those in the wild (tests/fixtures/offload/): Hugging Face's ZeRO-3
  template with `auto` values and `offload_*: {device: cpu, pin_memory: true}`, its NVMe variant (`aio`,
  `nvme_path`, `sub_group_size`, ...), a LLaVA-style `zero3_offload.json` and a DeepSpeed-Chat-style ZeRO-2
  `offload_optimizer: cpu` one (also switched to NVMe, as users do). Each trains through
  `shardwise.deepspeed.initialize` with DeepSpeed's client loop (and through `shardwise.initialize` where the
  dialect does not matter) to the weights of the same config without its offload sections (fp32, atol 1e-6;
  the NVMe template with a bfloat16 model, whose `bf16.enabled: auto` turns bf16 on, too).
  Every info line rank 0 logs is checked: each `auto` became what the engine holds, each offload line
  names what happens, no line names a key the file does not have. The templates are also run as Hugging
  Face's Trainer runs them (its two param groups and an lr scheduler passed; `save_16bit_model` at the end,
  whose file holds the trained weights).
* `shardwise.deepspeed.zero.Init(remote_device="nvme" | "cpu", config_dict_or_path=cfg)`: a model built under
  it trains as one built without offload; `nvme` without `offload_param: nvme` is an error naming both.
* A ZeRO-3 NVMe teacher beside a ZeRO-2 student in one process train as each does alone; each engine's
  folders go at its own `destroy`.
* A parameter frozen and thawed mid-run, or frozen at initialize and thawed, with NVMe offload at stage 2
  (2 ranks) and stage 3 (parameters only on NVMe) trains as without offload; so does LLaVA's first stage
  (embedding frozen, the rest passed as `model_parameters`) at stages 1-3 with NVMe.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
from _log_capture import logged as _logged
from _parity import ParityNet, assert_close_params, batch, full_params, make_model

import shardwise
import shardwise.deepspeed as deepspeed
from shardwise.testing import distributed_test, run_subtests

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "offload"
ATOL = 1e-6
OFFLOADS = ("offload_optimizer", "offload_param")


def _hf_model(seed: int = 0) -> ParityNet:
    """The parity model with a Hugging Face style `config.hidden_size`, from which `auto` bucket sizes follow."""
    model = make_model(seed)
    model.config = SimpleNamespace(hidden_size=16)  # type: ignore[assignment]
    return model


def _fixture(name: str, nvme: Optional[str]) -> dict[str, Any]:
    """A fixture file as a user edits it for this machine: `nvme_path` pointed at `nvme`."""
    config = json.loads((FIXTURES / name).read_text())
    for key in OFFLOADS:
        section = config["zero_optimization"].get(key)
        if section is not None and "nvme_path" in section:
            section["nvme_path"] = nvme
    return config


def _without_offload(config: dict[str, Any]) -> dict[str, Any]:
    plain = copy.deepcopy(config)
    for key in OFFLOADS:
        plain["zero_optimization"].pop(key, None)
    return plain


def _client_loop(engine: Any, steps: int) -> None:
    """DeepSpeed's loop: `engine(batch)`, `engine.backward(loss)`, `engine.step()` every micro-batch."""
    for micro in range(steps * engine.gradient_accumulation_steps()):
        loss = engine(*batch(micro, dist.get_rank()))
        engine.backward(loss)
        engine.step()


def _build(config: dict[str, Any], dialect: bool, client: bool, bf16: bool) -> Any:
    """An engine from `config`: through `shardwise.deepspeed` (with Hugging Face's optimizer and scheduler when
    `client`) or `shardwise.initialize`. `bf16`: a bfloat16 model, so `bf16.enabled: auto` turns bf16 on."""
    model = _hf_model().to(torch.bfloat16) if bf16 else _hf_model()
    if not dialect:
        return shardwise.initialize(model, config=config)
    if not client:
        return deepspeed.initialize(model=model, config=config)[0]
    # as Hugging Face's Trainer passes them: the config's all-`auto` sections give way
    optimizer = torch.optim.AdamW(_hf_groups(model), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    engine = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)[0]
    assert engine.lr_scheduler is scheduler
    return engine


def _run(config: dict[str, Any], dialect: bool, client: bool, save_to: Optional[str] = None,
         bf16: bool = False, steps: int = 4) -> tuple[dict[str, Any], list[str], str]:
    """Train one engine from `config`: its weights, the lines logged while it was built and trained, and what
    `_check_said` (and, given `save_to`, the saved 16-bit file) found wrong, reported by the caller once every
    rank is past its collectives."""
    with _logged() as lines:
        engine = _build(config, dialect, client, bf16)
        _client_loop(engine, steps)
    weights = full_params(engine)
    if save_to is not None:  # as Hugging Face's Trainer does at the end with `stage3_gather_16bit_weights_...`
        engine.save_16bit_model(save_to, "pytorch_model.bin")
        dist.barrier()
    wrong = ""
    try:
        _check_said(lines, engine)
        if save_to is not None and dist.get_rank() == 0:
            saved = torch.load(Path(save_to) / "pytorch_model.bin", weights_only=True)
            assert_close_params({k: v.float() for k, v in saved.items()}, weights, atol=0.0)
    except AssertionError as error:  # rank 0 alone has lines: raising here would leave rank 1 in a collective
        wrong = str(error)
    engine.destroy()
    return weights, lines, wrong


def _hf_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Hugging Face's Trainer's two groups: weights decay, biases do not (and get their own lr here)."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if not n.endswith("bias")], "weight_decay": 0.1},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0, "lr": 3e-2}]


_AUTO_LINE = re.compile(r"`([\w.]+): auto` became (.+?) \(")


def _value(text: str) -> Any:
    with contextlib.suppress(ValueError):
        return json.loads(text)
    return ast.literal_eval(text)


def _check_said(lines: list[str], engine: Any) -> None:
    """Every "`path: auto` became V" line says what the engine holds (the optimizer's own for its params), and
    so do the dialect's lines about weight decay and clipping."""
    for line in lines:
        found = _AUTO_LINE.search(line)
        if found is None:
            continue
        path, said = found.group(1), _value(found.group(2))
        if path.startswith("optimizer.params."):
            held = engine.optimizer.param_groups[0][path.rsplit(".", 1)[-1]]
            held = list(held) if isinstance(held, tuple) else held
        else:
            held = engine.config
            for part in path.split("."):
                held = held[part] if isinstance(held, dict) else getattr(held, part)
        assert held == said, f"{line!r}, but the engine holds {held!r}"
    for line in lines:  # the dialect's own lines, checked against the engine
        if "gets weight_decay 0.0" in line:
            decay = engine.optimizer.param_groups[0]["weight_decay"]
            assert decay == 0.0, f"{line!r}, but the optimizer has weight_decay {decay}"
        if "so gradients are clipped to norm 1.0" in line:
            assert engine.config.gradient_clipping == 1.0, (line, engine.config.gradient_clipping)


def _check_lines(lines: list[str], config: dict[str, Any], nvme: Optional[str], client: bool) -> None:
    """Rank 0's lines about offload and the dialect say what happens, and name only keys the file has."""
    if dist.get_rank() != 0:
        assert lines == [], lines
        return
    text = "\n".join(lines)
    zero = config["zero_optimization"]
    for key in OFFLOADS:
        section = zero.get(key) or {"device": "none"}
        path = f"zero_optimization.{key}"
        if section["device"] == "cpu":
            assert f"`{path}.device: cpu` holds already: this job runs on the CPU" in text, text
        if section["device"] == "nvme":
            assert f"`{path}.device: nvme`: this rank's" in text and f"under {nvme!r}" in text, text
        if section.get("pin_memory") and section["device"] == "nvme":
            assert f"`{path}.pin_memory` changes nothing on a CPU job" in text, text
        for name in ("buffer_count", "nvme_path", "ratio", "max_in_cpu", "buffer_size", "fast_init"):
            if name not in section:  # a key the file does not have is never reported as ignored
                assert not re.search(rf"`{path}`: [^\n]*`{name}`", text), (name, text)
    assert "`gradient_clipping: auto` became" not in text, "the dialect clips at 1.0: a line saying 0.0 is false"
    if config.get("gradient_clipping", "auto") == "auto":
        assert "`gradient_clipping` is not set, so gradients are clipped to norm 1.0" in text, text
    if client:
        assert "starts as DeepSpeed's" not in text, "the passed lr_scheduler runs, not the config's schedule"
    if "aio" in config:
        assert "`aio` ignored: it tunes DeepSpeed's async-I/O library" in text, text


def _config_case(name: str, nvme: str, dialect: bool = True, client: bool = False,
                 edit: Optional[Callable[[dict[str, Any]], None]] = None, bf16: bool = False) -> None:
    config = _fixture(name, nvme)
    if edit is not None:
        edit(config)
    gathers = config["zero_optimization"].get("stage3_gather_16bit_weights_on_model_save", False)
    save_to = str(Path(nvme).parent / f"saved-{name}-{dialect}") if gathers else None
    offloaded, lines, wrong = _run(config, dialect, client, save_to, bf16)
    plain, _, wrong_plain = _run(_without_offload(config), dialect, client, bf16=bf16)
    dist.barrier()
    assert os.listdir(nvme) == [], f"{os.listdir(nvme)} left under nvme_path after destroy"
    assert_close_params(offloaded, plain, atol=ATOL)
    assert not wrong and not wrong_plain, wrong or wrong_plain
    if dialect:
        _check_lines(lines, config, nvme, client)


def _small_sub_groups(config: dict[str, Any]) -> None:
    """Sub-groups smaller than a rank's shard (the template's 1e9 makes one), so the step is tiled."""
    config["zero_optimization"]["sub_group_size"] = 300


def _to_nvme(nvme: str) -> Callable[[dict[str, Any]], None]:
    """The DeepSpeed-Chat config as users switch it to NVMe: `device: nvme` and a path, small sub-groups."""
    def edit(config: dict[str, Any]) -> None:
        config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "pin_memory": True}
        config["zero_optimization"]["sub_group_size"] = 300
    return edit


@distributed_test(world_size=2, timeout=120)
def test_real_offload_configs_train_as_the_same_config_without_offload(tmp_path: Path) -> None:
    nvme = str(tmp_path / "nvme")
    os.makedirs(nvme, exist_ok=True)
    run_subtests(_config_case, [
        {"name": "hf_ds_config_zero3.json", "nvme": nvme, "client": True},
        {"name": "hf_ds_config_zero3_nvme.json", "nvme": nvme},
        {"name": "hf_ds_config_zero3_nvme.json", "nvme": nvme, "client": True, "edit": _small_sub_groups},
        {"name": "hf_ds_config_zero3_nvme.json", "nvme": nvme, "edit": _small_sub_groups, "bf16": True},
        {"name": "hf_ds_config_zero3_nvme.json", "nvme": nvme, "dialect": False},
        {"name": "zero3_offload.json", "nvme": nvme},
        {"name": "zero2_offload_optimizer.json", "nvme": nvme},
        {"name": "zero2_offload_optimizer.json", "nvme": nvme, "edit": _to_nvme(nvme)},
        {"name": "zero2_offload_optimizer.json", "nvme": nvme, "edit": _to_nvme(nvme), "dialect": False},
    ])


# ------------------------------------------------------------------ zero.Init(remote_device=...)


def _built_under_init(nvme: str, remote_device: Optional[str], offload: bool) -> tuple[dict[str, Any], list[str]]:
    """A model built under DeepSpeed's `zero.Init`, trained 4 steps by the DeepSpeed client loop, from Hugging
    Face's template for `remote_device` (`nvme`: the NVMe one), without its offload sections unless `offload`."""
    config = _fixture("hf_ds_config_zero3_nvme.json" if remote_device == "nvme" else "hf_ds_config_zero3.json", nvme)
    config = config if offload else _without_offload(config)
    with _logged() as lines:
        with deepspeed.zero.Init(remote_device=remote_device if offload else None, config_dict_or_path=config):
            model = _hf_model()
        dist.barrier()
        assert os.listdir(nvme) == [], "zero.Init keeps the shards in host memory until initialize"
        engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    if offload and remote_device == "nvme":
        assert Path(engine.strategy.shards.files.folder).parent == Path(nvme), "initialize moved the shards to files"
    _client_loop(engine, 4)
    weights = full_params(engine)
    engine.destroy()
    return weights, lines


def _remote_device_case(nvme: str, remote_device: str) -> None:
    got, lines = _built_under_init(nvme, remote_device, True)
    want, _ = _built_under_init(nvme, remote_device, False)
    assert_close_params(got, want, atol=ATOL)
    if dist.get_rank() == 0:
        said = {"nvme": f"zero.Init(remote_device='nvme'): each rank's shards are built in host memory and stay there "
                        f"until `initialize`, which moves them into files under {nvme!r}",
                "cpu": "zero.Init(remote_device='cpu'): each rank's shards are built where the model makes its "
                       "parameters (host memory unless torch's default device is set); `initialize` then places"}
        assert any(said[remote_device] in line for line in lines), lines


def test_remote_device_nvme_without_offload_param_nvme_is_an_error_naming_both() -> None:
    """Checked before anything is built or any process group is needed."""
    cpu_config = _fixture("hf_ds_config_zero3.json", None)
    with pytest.raises(ValueError, match=r"`remote_device='nvme'`.*`zero_optimization.offload_param.device` is "
                                         r"'cpu'; add `offload_param: \{device: nvme.*or pass `remote_device='cpu'`"):
        deepspeed.zero.Init(remote_device="nvme", config_dict_or_path=cpu_config)
    with pytest.raises(ValueError, match=r"is 'none' \(no config was passed\)"):
        deepspeed.zero.Init(remote_device="nvme")
    with pytest.raises(ValueError, match=r"`remote_device='disk'`; expected one of 'none', 'cpu' or 'nvme'"):
        shardwise.zero.Init(config=cpu_config, remote_device="disk")
    disabled = deepspeed.zero.Init(remote_device="nvme", config_dict_or_path=cpu_config, enabled=False)
    assert not disabled.enabled  # `enabled=stage == 3` scripts at other stages: nothing is checked or built


# ------------------------------------------------------------------ a teacher and a student in one process


def _teacher_config(nvme: str) -> dict[str, Any]:
    zero = {"stage": 3, "sub_group_size": 300, "stage3_param_persistence_threshold": 500,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 2},
            "offload_param": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0}}
    return {"zero_optimization": zero, "gradient_clipping": 0.5,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}


STUDENT = {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "Adam", "params": {"lr": 5e-3}}}


def _step(engine: Any, micro: int) -> None:
    engine.backward(engine(*batch(micro, dist.get_rank())))
    engine.step()


def _alone(config: dict[str, Any], seed: int, micros: int) -> dict[str, torch.Tensor]:
    engine = shardwise.initialize(make_model(seed), config=config)
    for micro in range(micros):
        _step(engine, micro)
    weights = full_params(engine)
    engine.destroy()
    return weights


def _distillation(root: str) -> None:
    """Teacher and student step in turn (the teacher also answers without gradients between, as it would
    when distilling); the teacher is destroyed first and the student trains on."""
    teacher_nvme, alone_nvme = Path(root) / "teacher", Path(root) / "alone"
    teacher_nvme.mkdir(exist_ok=True)
    alone_nvme.mkdir(exist_ok=True)
    teacher = shardwise.initialize(make_model(1), config=_teacher_config(str(teacher_nvme)), name="teacher")
    student = shardwise.initialize(make_model(2), config=STUDENT, name="student")
    for micro in range(12):
        if micro % 2 == 0:
            _step(teacher, micro // 2)
        with torch.no_grad():
            teacher(batch(micro, dist.get_rank())[0])
        _step(student, micro)
    teacher_weights = full_params(teacher)
    dist.barrier()
    assert len(os.listdir(teacher_nvme)) == 4, os.listdir(teacher_nvme)  # 2 ranks × (optimizer, parameters)
    teacher.destroy()
    dist.barrier()
    assert os.listdir(teacher_nvme) == [], f"{os.listdir(teacher_nvme)} left after the teacher's destroy"
    for micro in range(12, 16):
        _step(student, micro)
    assert_close_params(teacher_weights, _alone(_teacher_config(str(alone_nvme)), 1, 6), atol=ATOL)
    assert_close_params(full_params(student), _alone(STUDENT, 2, 16), atol=ATOL)
    student.destroy()


# ------------------------------------------------------------------ the trainable set changes mid-run


def _freeze_and_thaw(stage: int, nvme: Optional[str], frozen_at_start: bool = False) -> dict[str, torch.Tensor]:
    """fc1.weight stops training at step 3 and trains again at step 6 (noticed by the engine itself); or,
    `frozen_at_start` (LLaVA's first stage trains only its projector), starts frozen and trains from step 3."""
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 500}
    if nvme is not None and stage == 2:
        zero.update(offload_optimizer={"device": "nvme", "nvme_path": nvme, "buffer_count": 2}, sub_group_size=300)
    if nvme is not None and stage == 3:  # the masters in memory, the shards in files
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0}
    model = make_model()
    model.fc1.weight.requires_grad_(not frozen_at_start)
    engine = shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
                                  {"zero_optimization": zero, "gradient_clipping": 0.5})
    for step in range(9):
        if step in (3, 6):
            engine.module.fc1.weight.requires_grad_(step == 6 or frozen_at_start)
        _step(engine, step)
    weights = full_params(engine)
    engine.destroy()
    return weights


def _freezing(stage: int, nvme: str, frozen_at_start: bool = False) -> None:
    got = _freeze_and_thaw(stage, nvme, frozen_at_start)
    assert_close_params(got, _freeze_and_thaw(stage, None, frozen_at_start), atol=ATOL)


def _projector_only(stage: int, nvme: Optional[str]) -> dict[str, torch.Tensor]:
    """LLaVA's first stage: the embedding frozen, only the rest passed as `model_parameters`."""
    zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 500}
    if nvme is not None:
        zero.update(offload_optimizer={"device": "nvme", "nvme_path": nvme}, sub_group_size=300)
    if nvme is not None and stage == 3:
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0}
    config = {"zero_optimization": zero, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}
    model = _hf_model()
    model.embed.weight.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trained, config=config)
    _client_loop(engine, 4)
    weights = full_params(engine)
    engine.destroy()
    return weights


def _subset_case(stage: int, nvme: str) -> None:
    assert_close_params(_projector_only(stage, nvme), _projector_only(stage, None), atol=ATOL)


@distributed_test(world_size=2, timeout=120)
def test_zero_init_remote_device_several_engines_and_freezing_with_nvme(tmp_path: Path) -> None:
    nvme = str(tmp_path)
    run_subtests(_remote_device_case, [{"nvme": nvme, "remote_device": "nvme"}, {"nvme": nvme, "remote_device": "cpu"}])
    run_subtests(_distillation, [{"root": nvme}])
    run_subtests(_freezing, [{"stage": 2, "nvme": nvme}, {"stage": 3, "nvme": nvme},
                             {"stage": 2, "nvme": nvme, "frozen_at_start": True},
                             {"stage": 3, "nvme": nvme, "frozen_at_start": True}])
    run_subtests(_subset_case, [{"stage": stage, "nvme": nvme} for stage in (1, 2, 3)])
    assert sorted(os.listdir(tmp_path)) == ["alone", "teacher"], os.listdir(tmp_path)
    assert os.listdir(tmp_path / "alone") == [] and os.listdir(tmp_path / "teacher") == []


def test_a_value_replacing_an_auto_is_kept_and_the_line_about_the_old_value_goes() -> None:
    """`Config.replace` as the dialect uses it: a value given where `auto` waited is not re-filled by `resolve`,
    and a line about the replaced key's old value (`gradient_clipping: auto` became 0.0) is not logged."""
    loaded = shardwise.Config.load({"gradient_clipping": "auto",
                                    "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "weight_decay": "auto"}}})
    assert "optimizer.params.weight_decay" in loaded.pending
    assert any(note.path == "gradient_clipping" for note in loaded.notes)
    section = loaded.optimizer.model_copy(update={"params": {"lr": 0.1, "weight_decay": 0.0}})
    resolved = loaded.replace(optimizer=section, gradient_clipping=1.0).resolve()
    assert resolved.optimizer.params["weight_decay"] == 0.0 and resolved.gradient_clipping == 1.0
    assert not any("gradient_clipping" in note.message or "weight_decay" in note.message for note in resolved.notes)
    kept = loaded.replace(optimizer=loaded.optimizer).resolve()  # a section given back unchanged still waits
    assert kept.optimizer.params.get("weight_decay") is None and any("weight_decay: auto" in n.message for n in kept.notes)
