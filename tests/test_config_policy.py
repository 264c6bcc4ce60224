"""The one rule for DeepSpeed's keys, Hugging Face's `auto`, aliases and string values (one process).

The configs under tests/configs/ reproduce what real DeepSpeed files contain (written for these
tests): Hugging Face's `auto` everywhere it appears, DeepSpeed's legacy names, switched-off
features, tuning knobs, hand-written JSON. Each is asserted accepted or rejected by the rule.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shardwise.cli.commands import main
from shardwise.config import Config, ConfigError
from shardwise.config.catalog import ALIASES, CATALOG, Entry
from shardwise.config.registry import OPTIMIZERS, REQUIRED, SCHEDULES
from shardwise.optim.optimizers import build_optimizer
from shardwise.optim.schedulers import SCHEDULERS

CONFIGS = Path(__file__).parent / "configs"


def problems_of(source: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        Config.load(source)
    return info.value.problems


def noted_paths(config: Config) -> set[str]:
    return {note.path for note in config.notes}


class HiddenConfig:
    hidden_size = 16


class HFModel(nn.Module):
    """A model with a transformers-style `config.hidden_size` (what `auto` bucket sizes read)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = HiddenConfig()
        self.proj = nn.Linear(16, 16).to(dtype)


# ------------------------------------------------------------------ every catalog key, by the rule

_CANDIDATES: list[Any] = [False, {"enabled": False}, {}, None, 0, 1, -1, "mean", "sum", True,
                          {"enabled": True}, {"x": 1}, {"deepcompile": True}, {"autotp_size": 2}, 2,
                          {"partition_activations": True}, {"pipeline_stage": True}]


def _off_and_on(entry: Entry) -> tuple[Any, Any]:
    off = next(v for v in _CANDIDATES if entry.is_off(v))
    on = next(v for v in _CANDIDATES if not entry.is_off(v))
    return off, on


def _nested(path: str, value: Any) -> dict[str, Any]:
    data: Any = value
    for part in reversed(path.split(".")):
        data = {part: data}
    return data


@pytest.mark.parametrize("path", sorted(CATALOG))
def test_every_catalog_key_is_accepted_with_a_note_or_rejected_naming_its_feature(path: str) -> None:
    entry = CATALOG[path]
    if entry.feature is None:  # a knob: any value, one info line
        config = Config.load(_nested(path, 1 if "size" in path or "threshold" in path else True))
        assert [n.path for n in config.notes] == [path] and "ignored" in config.notes[0].message
        return
    off, on = _off_and_on(entry)
    config = Config.load(_nested(path, off))
    assert [n.path for n in config.notes] == [path], "a switched-off feature is accepted with one note"
    (line,) = problems_of(_nested(path, on))
    assert line.startswith(f"`{path}` turns on {entry.feature}, a DeepSpeed feature shardwise does not implement")


def test_real_patterns_are_accepted_with_notes() -> None:
    off = Config.load(CONFIGS / "switched_off.json")
    assert {"tensorboard", "wandb", "hybrid_engine", "fp16.fp16_master_weights_and_grads",
            "zero_optimization.offload_optimizer", "activation_checkpointing"} <= noted_paths(off)
    assert off.zero_optimization.offload_optimizer is None and off.zero_optimization.stage == 1
    knobs = Config.load(CONFIGS / "knobs.json")
    assert {"zero_optimization.round_robin_gradients",
            "zero_allow_untested_optimizer", "bf16.loss_scale", "seq_parallel_communication_data_type",
            "prescale_gradients", "gradient_predivide_factor", "checkpoint.tag_validation"} <= noted_paths(knobs)
    # `sub_group_size` acts with NVMe offload; without it, resolve says it changes nothing
    assert "zero_optimization.sub_group_size" in noted_paths(knobs.resolve(world_size=1))
    assert knobs.bf16.enabled and knobs.checkpoint.timeout == 60
    (note,) = [n for n in knobs.notes if n.path == "seq_parallel_communication_data_type"]
    assert "sequence parallelism" in note.message  # not "did you mean communication_data_type?"


@pytest.mark.parametrize(("raw", "feature"), [
    ({"zero_optimization": {"zero_quantized_weights": True}}, "ZeRO++ quantized weights"),
    ({"tensorboard": {"enabled": True, "output_path": "x"}}, "the TensorBoard monitor"),
    ({"gradient_allreduce_op": "sum"}, "summing gradients"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}}, "1-bit Adam"),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, "OneCycle"),
])
def test_features_shardwise_lacks_are_errors_naming_them(raw: dict[str, Any], feature: str) -> None:
    (line,) = problems_of(raw)
    assert feature in line and ("remove" in line or "use one of" in line), line


def test_unknown_keys_name_the_closest_known_key_including_deepspeed_ones() -> None:
    assert problems_of({"zero_optimization": {"sub_group_sise": 1}}) == [
        "unknown key `zero_optimization.sub_group_sise`; did you mean `sub_group_size`?"]
    assert problems_of({"tensorbord": {}}) == ["unknown key `tensorbord`; did you mean `tensorboard`?"]


# ---------------------------------------------------------------------------- aliases, values


def test_legacy_and_alias_names_are_read_as_the_canonical_ones() -> None:
    config = Config.load(CONFIGS / "legacy_names.json")
    zero = config.zero_optimization
    assert config.bf16.enabled and zero.stage3_gather_16bit_weights_on_model_save
    assert (zero.stage3_prefetch_bucket_size, zero.stage3_param_persistence_threshold) == (1000, 200)
    assert (zero.stage3_max_live_parameters, zero.stage3_max_reuse_distance) == (30_000_000, 40_000_000)
    assert zero.offload_optimizer is None and zero.offload_param is None
    dumped = config.to_dict()
    assert "bfloat16" not in dumped and "stage3_gather_16bit_weights_on_model_save" in dumped["zero_optimization"]
    assert {"bfloat16", "zero_optimization.prefetch_bucket_size",
            "zero_optimization.stage3_gather_fp16_weights_on_model_save"} <= noted_paths(config)
    assert Config.load({"zero_optimization": {"gather_16bit_weights_on_model_save": True}}) \
        .zero_optimization.stage3_gather_16bit_weights_on_model_save


def test_alias_and_canonical_name_together_is_an_error() -> None:
    (line,) = problems_of({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}})
    assert line == ("`bfloat16` and `bf16` are the same setting (`bfloat16` is DeepSpeed's other name for it); "
                    "keep only `bf16`")


def test_every_alias_names_a_real_field_or_catalog_key() -> None:
    for section, aliases in ALIASES.items():
        for alias in aliases.values():
            target = f"{section}.{alias.name}" if section else alias.name
            holder: Any = Config
            for part in target.split(".")[:-1]:
                holder = holder.model_fields[part].annotation
            assert target in CATALOG or target.split(".")[-1] in holder.model_fields, target


def test_hand_written_json_reads_as_deepspeed_reads_it() -> None:
    config = Config.load(CONFIGS / "commented.json")
    assert config.train_micro_batch_size_per_gpu == 4 and config.gradient_clipping == 1.0
    assert config.optimizer is not None and config.optimizer.type == "Adam"
    assert config.optimizer.params == {"lr": 1e-3, "betas": [0.9, 0.95], "adam_w_mode": False}
    assert config.fp16.enabled and config.fp16.loss_scale_window == 500
    assert config.zero_optimization.reduce_bucket_size == 50_000_000 and not config.zero_optimization.reduce_scatter
    optimizer = build_optimizer(config.optimizer, [nn.Parameter(torch.zeros(2))])
    assert type(optimizer) is torch.optim.Adam and optimizer.defaults["betas"] == (0.9, 0.95)


def test_yaml_exponents_without_a_dot_are_numbers() -> None:
    config = Config.load(CONFIGS / "yaml_numbers.yaml")
    assert config.optimizer is not None and config.optimizer.params == {"lr": 3e-4, "weight_decay": 1e-2}
    assert config.zero_optimization.reduce_bucket_size == 5_000_000


def test_duplicate_json_keys_are_an_error(tmp_path: Path) -> None:
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ConfigError, match="`train_batch_size` appears twice"):
        Config.load(path)


# ------------------------------------------------------------------------------------ auto


def test_auto_at_load_pending_and_round_trip() -> None:
    config = Config.load(CONFIGS / "hf_zero2_auto.json")
    assert config.gradient_clipping == 0.0 and config.train_micro_batch_size_per_gpu is None
    assert set(config.pending) == {
        "fp16.enabled", "bf16.enabled", "zero_optimization.reduce_bucket_size",
        *(f"optimizer.params.{k}" for k in ("lr", "betas", "eps", "weight_decay")),
        *(f"scheduler.params.{k}" for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps")),
    }
    assert config.to_dict()["fp16"]["enabled"] == "auto"
    assert Config.load(config.to_dict()) == config
    # The message that used to mislead: a pending total_num_steps is not "expected an integer".
    decay = Config.load({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}})
    assert "scheduler.params.total_num_steps" in decay.pending


def test_resolve_fills_auto_from_the_model_and_the_world() -> None:
    config = Config.load(CONFIGS / "hf_zero3_auto.json")
    resolved = config.resolve(world_size=2, model=HFModel(torch.bfloat16), total_num_steps=100)
    assert resolved.pending == {} and resolved.bf16.enabled
    zero = resolved.zero_optimization
    assert (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size, zero.stage3_param_persistence_threshold) == (
        256, 230, 160)
    assert (resolved.train_batch_size, resolved.train_micro_batch_size_per_gpu,
            resolved.gradient_accumulation_steps) == (16, 2, 4)
    assert resolved.scheduler is not None
    assert resolved.scheduler.params == {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 0,
                                         "total_num_steps": 100}
    assert resolved.optimizer is not None and resolved.optimizer.params == {}
    assert zero.offload_optimizer is not None  # holds on this CPU job
    assert "`bf16.enabled: auto` became true (the model's dtype)" in [n.message for n in resolved.notes]


def test_resolve_gives_way_to_what_initialize_was_passed() -> None:
    config = Config.load(CONFIGS / "hf_zero2_auto.json")
    model = HFModel(torch.float16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.25)
    resolved = config.resolve(model=model, optimizer=optimizer, lr_scheduler=lambda opt: None)
    assert resolved.optimizer is None and resolved.scheduler is None and resolved.fp16.enabled
    # Only the optimizer passed: the scheduler warms up to its lr.
    kept = config.resolve(model=HFModel(), optimizer=optimizer)
    assert kept.scheduler is not None and kept.scheduler.params["warmup_max_lr"] == 0.25
    assert not kept.fp16.enabled and not kept.bf16.enabled


def test_resolve_without_a_total_step_count_says_how_to_give_one() -> None:
    config = Config.load(CONFIGS / "hf_zero3_auto.json")
    with pytest.raises(ConfigError, match="`scheduler.params.total_num_steps` is `auto`.*total_num_steps="):
        config.resolve(model=HFModel())


def test_offload_to_cpu_is_zero_offload_on_a_gpu_job_and_holds_already_on_a_cpu_job() -> None:
    section = {"device": "cpu", "pin_memory": True, "ratio": 0.5, "buffer_count": 3}
    config = Config.load({"zero_optimization": {"stage": 2, "sub_group_size": 1000, "offload_optimizer": section}})
    gpu = config.resolve(device="cuda")
    offload = gpu.zero_optimization.offload_optimizer
    assert offload is not None and (offload.device, offload.pin_memory, offload.ratio) == ("cpu", True, 0.5)
    lines = [n.message for n in gpu.notes]
    assert any(line.startswith("`zero_optimization.offload_optimizer.device: cpu`: ZeRO-Offload: this rank's fp32 "
                               "master weights, gradients and optimizer state live in host memory") and
               "up to 1000 elements at a time while the model trains on cuda" in line for line in lines), lines
    assert "`zero_optimization.offload_optimizer`: `buffer_count` ignored (they tune the offload itself)" in lines
    assert not any("sub_group_size` changes nothing" in line for line in lines), lines
    cpu = config.resolve(device="cpu")
    assert cpu.zero_optimization.offload_optimizer is not None
    lines = [n.message for n in cpu.notes]
    assert any("`zero_optimization.offload_optimizer.device: cpu` holds already" in line for line in lines), lines
    for key in ("pin_memory", "ratio"):
        assert (f"`zero_optimization.offload_optimizer.{key}` changes nothing on a CPU job: nothing is copied to an "
                "accelerator") in lines
    assert any("sub_group_size` changes nothing here" in line for line in lines), lines
    for stage, key, wanted in ((0, "offload_optimizer", "1, 2 or 3"), (2, "offload_param", "3")):
        wrong = Config.load({"zero_optimization": {"stage": stage, key: {"device": "cpu"}}})
        with pytest.raises(ConfigError, match=rf"`zero_optimization.{key}.device: cpu` needs ZeRO stage {wanted}, "
                                              f"and this is stage {stage}"):
            wrong.resolve(device="cuda")
        wrong.resolve(device="cpu")  # holds already: nothing is moved on a CPU job


def test_parameter_shards_on_nvme_act_on_gpu_and_cpu_jobs_and_say_where_they_go(tmp_path: Path) -> None:
    nvme = {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 1000}
    config = Config.load({"zero_optimization": {"stage": 3, "offload_param": nvme, "offload_optimizer": nvme}})
    for device, onto in (("cuda", ", copied to cuda as the unit is gathered"), ("cpu", "")):
        (line,) = [n.message for n in config.resolve(device=device).notes
                   if n.path == "zero_optimization.offload_param"]
        assert line.startswith("`zero_optimization.offload_param.device: nvme`: this rank's shard of each unit of "
                               f"parameters lives in a file under {str(tmp_path)!r}, at most 1000 elements of them in "
                               f"host memory{onto} (docs/offload.md)"), line


def test_notes_are_logged_once_per_config(caplog: pytest.LogCaptureFixture) -> None:
    config = Config.load(CONFIGS / "knobs.json")
    with caplog.at_level(logging.INFO, logger="shardwise"):
        resolved = config.resolve(world_size=1)
        resolved.resolve(world_size=1)
    lines = [r.getMessage() for r in caplog.records if "sub_group_size" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("config: `zero_optimization.sub_group_size` changes nothing here")


# ------------------------------------------------------------------------ registry, CLI


def test_one_optimizer_registry_builds_every_named_optimizer() -> None:
    for name, spec in OPTIMIZERS.items():
        config = Config.load({"optimizer": {"type": name.lower(), "params": {"lr": 0.01}}}).optimizer
        assert config is not None and config.type == name
        built = build_optimizer(config, [nn.Parameter(torch.zeros(3))])
        expected = torch.optim.AdamW if spec.torch_class is torch.optim.Adam else spec.torch_class
        assert type(built) is expected


def test_schedule_descriptions_match_the_implementations() -> None:
    import inspect

    assert set(SCHEDULES) == set(SCHEDULERS)
    for name, described in SCHEDULES.items():
        signature = inspect.signature(SCHEDULERS[name]).parameters
        # Keyword-only options (`deepspeed_start`) come from outside `scheduler.params`.
        actual = {k: (REQUIRED if p.default is inspect.Parameter.empty else p.default)
                  for k, p in signature.items() if k != "optimizer" and p.kind is not inspect.Parameter.KEYWORD_ONLY}
        assert actual == described, name


def test_config_imports_no_runtime_module() -> None:
    import subprocess
    import sys

    import shardwise

    # An empty stand-in for the package (its __init__ imports the runtime), so that importing
    # shardwise.config shows exactly what the config itself pulls in.
    code = ("import sys, types; pkg = types.ModuleType('shardwise'); pkg.__path__ = [sys.argv[1]]; "
            "sys.modules['shardwise'] = pkg; import shardwise.config; "
            "print(sorted(m for m in sys.modules if m.startswith('shardwise.') and not m.startswith('shardwise.config')))")
    package_dir = str(Path(shardwise.__file__).parent)
    out = subprocess.run([sys.executable, "-c", code, package_dir], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_validate_prints_what_each_auto_became(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "validate", str(CONFIGS / "hf_zero2_auto.json"), "--world-size", "2", "--format",
                 "json"]) == 0
    captured = capsys.readouterr()
    assert '"enabled": "auto"' in captured.out
    assert "note: `gradient_clipping: auto` became 0.0 (the default)" in captured.err
    assert "note: `fp16.enabled: auto` resolves at initialize: the model's dtype" in captured.err
    assert "note: `zero_optimization.round_robin_gradients` ignored" in captured.err
