"""Config validation, error messages, batch-size arithmetic and file loading."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import yaml

from shardwise.config import BatchSizes, Config, ConfigError, load_configs

DEEPSPEED_CONFIG = {
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "steps_per_print": 100,
    "wall_clock_breakdown": False,
    "optimizer": {
        "type": "Adam",
        "params": {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 500},
    },
    "fp16": {
        "enabled": True,
        "auto_cast": False,
        "loss_scale": 0,
        "initial_scale_power": 16,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "consecutive_hysteresis": False,
        "min_loss_scale": 1,
    },
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
    },
}


def problems_of(source: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        Config.load(source)  # type: ignore[arg-type]
    return info.value.problems


def test_deepspeed_config_loads_unchanged() -> None:
    cfg = Config.load(DEEPSPEED_CONFIG)
    assert cfg.optimizer is not None and cfg.optimizer.type == "Adam"
    assert cfg.optimizer.params == DEEPSPEED_CONFIG["optimizer"]["params"]
    assert cfg.scheduler is not None and cfg.scheduler.type == "WarmupLR"
    assert cfg.fp16.enabled and cfg.fp16.loss_scale == 0 and cfg.fp16.min_loss_scale == 1.0
    assert cfg.zero_optimization.stage == 2
    assert cfg.zero_optimization.reduce_bucket_size == 200_000_000
    assert cfg.batch_sizes(2) == BatchSizes(32, 4, 4)
    assert Config.load(cfg.to_dict()) == cfg
    assert Config.load(cfg) is cfg


def test_defaults_follow_plain_pytorch() -> None:
    cfg = Config.load({})
    assert cfg.gradient_clipping == 0.0 and cfg.optimizer is None and cfg.scheduler is None
    assert not cfg.fp16.enabled and not cfg.bf16.enabled and cfg.zero_optimization.stage == 0
    assert not cfg.checkpoint.allow_pickle and cfg.notes == () and cfg.pending == {}


def test_names_are_case_insensitive_and_canonical() -> None:
    cfg = Config.load({
        "optimizer": {"type": "adamw"}, "scheduler": {"type": "warmupdecaylr", "params": {"total_num_steps": 2e3}},
        "communication_data_type": "FP32",
    })
    assert (cfg.optimizer.type, cfg.scheduler.type) == ("AdamW", "WarmupDecayLR")  # type: ignore[union-attr]
    assert cfg.scheduler.params["total_num_steps"] == 2000  # type: ignore[union-attr]
    assert cfg.communication_data_type == "fp32"
    assert Config.load({"communication_data_type": "bfp16"}).communication_data_type == "bf16"  # DeepSpeed's name
    assert Config.load({"communication_data_type": "Half"}).communication_data_type == "fp16"


def test_unknown_top_level_key_suggests_closest() -> None:
    assert problems_of({"gradient_cliping": 1.0}) == [
        "unknown key `gradient_cliping`; did you mean `gradient_clipping`?"
    ]


def test_unknown_nested_key_suggests_closest() -> None:
    assert problems_of({"zero_optimization": {"stag": 2}}) == [
        "unknown key `zero_optimization.stag`; did you mean `stage`?"
    ]


def test_stage_out_of_range_names_the_range() -> None:
    (line,) = problems_of({"zero_optimization": {"stage": 7}})
    assert line == "`zero_optimization.stage`: got 7; expected an integer in 0..3"


def test_negative_lr() -> None:
    (line,) = problems_of({"optimizer": {"type": "Adam", "params": {"lr": -0.1}}})
    assert line.startswith("`optimizer.params.lr`: got -0.1; expected a number >= 0")


def test_unknown_optimizer_param_names_torch_argument() -> None:
    (line,) = problems_of({"optimizer": {"type": "SGD", "params": {"momentun": 0.9}}})
    assert "`optimizer.params.momentun`" in line and "did you mean `momentum`?" in line


def test_adam_value_checks_and_extras() -> None:
    lines = problems_of({"optimizer": {"type": "Adam", "params": {
        "betas": [0.9, 1.0], "eps": 0, "weight_decay": -1, "adam_w_mode": "yes"}}})
    assert [line.split(":")[0] for line in lines] == [
        "`optimizer.params.betas`", "`optimizer.params.eps`",
        "`optimizer.params.weight_decay`", "`optimizer.params.adam_w_mode`",
    ]
    ok = Config.load({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "torch_adam": True}}})
    assert ok.optimizer is not None and ok.optimizer.params["adam_w_mode"] is False


def test_fp16_and_bf16_both_enabled() -> None:
    (line,) = problems_of({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert "`fp16.enabled`" in line and "`bf16.enabled`" in line


def test_loss_scale_window_zero() -> None:
    (line,) = problems_of({"fp16": {"loss_scale_window": 0}})
    assert line == "`fp16.loss_scale_window`: got 0; expected an integer >= 1"


def test_not_implemented_deepspeed_key() -> None:
    (line,) = problems_of({"zero_optimization": {"stage": 3, "offload_param": {"device": "disk", "nvme_path": "/x"}}})
    assert line == ("`zero_optimization.offload_param.device: disk` is not an offload device; expected `cpu`, "
                    "`nvme` or `none`; set one of them or remove the section")


def test_all_problems_are_listed_together() -> None:
    with pytest.raises(ConfigError) as info:
        Config.load({"bogus": 1, "zero_optimization": {"stage": 9}, "fp16": {"enabled": True},
                     "bf16": {"enabled": True}, "optimizer": {"type": "Adam", "params": {"lr": -1}}})
    assert len(info.value.problems) == 4
    message = str(info.value)
    assert message.startswith("invalid shardwise config (4 problems):")
    assert all(f"  - {line}" in message for line in info.value.problems)
    assert pickle.loads(pickle.dumps(info.value)).problems == info.value.problems


def test_scheduler_params_are_validated() -> None:
    lines = problems_of({"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_typ": "log"}}})
    assert lines == [
        "unknown key `scheduler.params.warmup_typ`; did you mean `warmup_type`?",
        "`scheduler.params.total_num_steps` is required for WarmupCosineLR; "
        "set it to the total number of optimizer steps",
    ]
    (line,) = problems_of({"scheduler": {"type": "WarmupDecayLR",
                                         "params": {"total_num_steps": 10, "warmup_num_steps": 10}}})
    assert line.startswith("`scheduler.params.total_num_steps`: got 10; expected an integer > warmup_num_steps (10)")


def test_pydantic_errors_never_escape() -> None:
    assert problems_of({"zero_optimization": 3}) == ["`zero_optimization`: got 3; expected a mapping of settings"]
    with pytest.raises(ConfigError, match="`zero_optimization.stage`"):
        Config(zero_optimization={"stage": -1})
    with pytest.raises(ConfigError, match="expected a dict"):
        Config.load(42)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("given", "world", "expected"),
    [
        ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2,
         BatchSizes(16, 4, 2)),
        ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}, 2, BatchSizes(16, 4, 2)),
        ({"train_batch_size": 16, "gradient_accumulation_steps": 2}, 2, BatchSizes(16, 4, 2)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2, BatchSizes(16, 4, 2)),
        ({"train_batch_size": 16}, 4, BatchSizes(16, 4, 1)),
        ({"train_micro_batch_size_per_gpu": 4}, 3, BatchSizes(12, 4, 1)),
        ({"gradient_accumulation_steps": 5}, 2, BatchSizes(None, None, 5)),
        ({}, 2, BatchSizes(None, None, 1)),
    ],
)
def test_batch_size_rules(given: dict, world: int, expected: BatchSizes) -> None:
    assert Config.load(given).batch_sizes(world) == expected


def test_inconsistent_batch_triple_shows_arithmetic() -> None:
    cfg = Config.load({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})
    with pytest.raises(ConfigError) as info:
        cfg.batch_sizes(2)
    assert info.value.problems == [
        "train_batch_size 32 != train_micro_batch_size_per_gpu 4 × gradient_accumulation_steps 2 × world_size 2 "
        "= 16; fix one of them"
    ]


@pytest.mark.parametrize(
    ("given", "world", "arithmetic"),
    [
        ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 2,
         "train_batch_size 30 is not divisible by train_micro_batch_size_per_gpu 4 × world_size 2 = 8"),
        ({"train_batch_size": 30, "gradient_accumulation_steps": 4}, 2,
         "train_batch_size 30 is not divisible by gradient_accumulation_steps 4 × world_size 2 = 8"),
        ({"train_batch_size": 10}, 4, "train_batch_size 10 is not divisible by world_size 4 = 4"),
    ],
)
def test_indivisible_train_batch(given: dict, world: int, arithmetic: str) -> None:
    with pytest.raises(ConfigError, match=arithmetic):
        Config.load(given).batch_sizes(world)


def test_batch_sizes_rejects_bad_world_size() -> None:
    with pytest.raises(ValueError, match="world_size"):
        Config.load({}).batch_sizes(0)


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml"])
def test_load_from_file(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"ds{suffix}"
    path.write_text(json.dumps(DEEPSPEED_CONFIG) if suffix == ".json" else yaml.safe_dump(DEEPSPEED_CONFIG))
    assert Config.load(path) == Config.load(DEEPSPEED_CONFIG)
    assert Config.load(str(path)) == Config.load(DEEPSPEED_CONFIG)


def test_file_errors_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match="nope.json` does not exist"):
        Config.load(missing)
    bad = tmp_path / "bad.yaml"
    bad.write_text("zero_optimization:\n  stag: 1\n")
    with pytest.raises(ConfigError) as info:
        Config.load(bad)
    assert str(bad) in str(info.value) and "did you mean `stage`?" in str(info.value)
    with pytest.raises(ConfigError, match="unsupported suffix"):
        Config.load(tmp_path / "x.toml")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Config.load(broken)


def test_load_configs_two_engines(tmp_path: Path) -> None:
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump({"engines": {
        "student": {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}},
        "teacher": {"zero_optimization": {"stage": 1}},
    }}))
    configs = load_configs(path)
    assert sorted(configs) == ["student", "teacher"]
    assert configs["student"].zero_optimization.stage == 3 and configs["student"].bf16.enabled
    assert configs["teacher"].zero_optimization.stage == 1 and not configs["teacher"].bf16.enabled


def test_load_configs_reports_nested_paths(tmp_path: Path) -> None:
    path = tmp_path / "engines.json"
    path.write_text(json.dumps({"engines": {
        "student": {"zero_optimization": {"stage": 2}},
        "teacher": {"zero_optimization": {"stage": 5, "stag": 1}},
    }}))
    with pytest.raises(ConfigError) as info:
        load_configs(path)
    # Key problems (found before any value is validated) come first.
    assert info.value.problems == [
        "unknown key `engines.teacher.zero_optimization.stag`; did you mean `stage`?",
        "`engines.teacher.zero_optimization.stage`: got 5; expected an integer in 0..3",
    ]


def test_load_configs_requires_engines(tmp_path: Path) -> None:
    path = tmp_path / "plain.json"
    path.write_text(json.dumps({"train_batch_size": 8}))
    with pytest.raises(ConfigError, match="top-level key `engines`"):
        load_configs(path)
