"""The value rules of a config, for dicts as for files: numbers take numbers, everything finite, bounded.

A dict passed in Python follows the same rules as a file (`Config.load`, `Config(**kwargs)`); hostile
files themselves (alias bombs, deep nesting, bad bytes) are tests/test_faults_config.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from shardwise.config import Config, ConfigError, load_configs
from shardwise.config.errors import MAX_SHOWN


def problems_of(source: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        Config.load(source)
    return info.value.problems


# ------------------------------------------------------------------- issue 29: offload sections


@pytest.mark.parametrize(("section", "typo", "closest"), [
    ("offload_optimizer", "pin_memroy", "pin_memory"),
    ("offload_param", "buffer_cout", "buffer_count"),
    ("offload_param", "max_in_cpus", "max_in_cpu"),
])
@pytest.mark.parametrize("device", ["cpu", "none"])
def test_unknown_offload_keys_are_unknown_key_errors(section: str, typo: str, closest: str, device: str) -> None:
    raw = {"zero_optimization": {"stage": 3, section: {"device": device, typo: 1}}}
    assert problems_of(raw) == [f"unknown key `zero_optimization.{section}.{typo}`; did you mean `{closest}`?"]


def test_an_offload_key_far_from_any_names_at_most_three() -> None:
    (line,) = problems_of({"zero_optimization": {"offload_optimizer": {"device": "cpu", "zzzz": 1}}})
    assert line.startswith("unknown key `zero_optimization.offload_optimizer.zzzz`; remove it (nearest known keys: ")
    assert line.count("`") == 2 + 2 * 3, line


# ---------------------------------------------------------------------- numbers take numbers


@pytest.mark.parametrize(("raw", "path"), [
    ({"zero_optimization": {"stage": True}}, "zero_optimization.stage"),
    ({"train_micro_batch_size_per_gpu": True}, "train_micro_batch_size_per_gpu"),
    ({"gradient_accumulation_steps": False}, "gradient_accumulation_steps"),
    ({"gradient_clipping": True}, "gradient_clipping"),
    ({"comms": {"timeout": True}}, "comms.timeout"),
    ({"fp16": {"loss_scale_window": "true"}}, "fp16.loss_scale_window"),
])
def test_a_boolean_is_not_a_number(raw: dict[str, Any], path: str) -> None:
    (line,) = problems_of(raw)
    assert line.startswith(f"`{path}`: got ") and "is a boolean, not a number; write the number" in line, line
    with pytest.raises(ConfigError, match="is a boolean"):
        Config(**raw)


@pytest.mark.parametrize(("raw", "expected"), [
    ({"optimizer": {"type": "SGD", "params": {"momentum": True}}}, "expected a number"),
    ({"optimizer": {"type": "SGD", "params": {"nesterov": 1}}}, "expected true or false"),
    ({"optimizer": {"type": "Adam", "params": {"lr": True}}}, "expected a number >= 0"),
])
def test_optimizer_arguments_take_the_kind_of_torchs_default(raw: dict[str, Any], expected: str) -> None:
    (line,) = problems_of(raw)
    assert expected in line, line


def test_numeric_text_is_read_as_a_number_with_an_info_line() -> None:
    config = Config.load({"zero_optimization": {"stage": "2", "reduce_bucket_size": "5e8"},
                          "optimizer": {"type": "AdamW", "params": {"lr": "1e-3"}}, "fp16": {"enabled": "false"}})
    assert config.zero_optimization.stage == 2 and config.zero_optimization.reduce_bucket_size == 500_000_000
    assert config.optimizer is not None and config.optimizer.params["lr"] == 1e-3 and not config.fp16.enabled
    messages = [note.message for note in config.notes]
    assert "`zero_optimization.stage: '2'` is text; read as 2 (write it without quotes to silence this line)" \
        in messages
    assert {n.path for n in config.notes} == {"zero_optimization.stage", "zero_optimization.reduce_bucket_size",
                                              "optimizer.params.lr", "fp16.enabled"}


def test_plain_numbers_and_whole_floats_need_no_note(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("zero_optimization: {stage: 2, reduce_bucket_size: 5e8}\noptimizer: {type: AdamW, params: "
                    "{lr: 3e-4}}\n")
    config = Config.load(path)
    assert config.zero_optimization.reduce_bucket_size == 500_000_000 and config.notes == ()
    assert problems_of({"zero_optimization": {"stage": 1.5}}) == [
        "`zero_optimization.stage`: got 1.5; expected an integer in 0..3: it has a fractional part; write a whole "
        "number"]


@pytest.mark.parametrize("text", ["1e999", "inf", "nan", "two"])
def test_text_that_is_no_finite_number_is_refused(text: str) -> None:
    (line,) = problems_of({"gradient_clipping": text})
    assert line == (f"`gradient_clipping`: got '{text}'; expected a number >= 0: a string that is not a number; "
                    "write the number without quotes")


_PLACES = {
    "comms.timeout": lambda v: {"comms": {"timeout": v}},
    "optimizer.params.lr": lambda v: {"optimizer": {"type": "Adam", "params": {"lr": v}}},
    "optimizer.params.betas.1": lambda v: {"optimizer": {"type": "Adam", "params": {"betas": [0.9, v]}}},
    "scheduler.params.warmup_max_lr": lambda v: {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": v}}},
    "fp16.loss_scale": lambda v: {"fp16": {"loss_scale": v}},
    "tensorboard.x": lambda v: {"tensorboard": {"x": v}},
}


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("path", list(_PLACES))
def test_non_finite_numbers_are_refused_anywhere(path: str, value: float) -> None:
    (line,) = problems_of(_PLACES[path](value))
    assert line.startswith(f"`{path}`: got {value}; expected a finite number"), line


@pytest.mark.parametrize(("raw", "expected"), [
    ({"gradient_accumulation_steps": 10**21}, "`gradient_accumulation_steps`: got 1000000000000000000000; "
                                              "expected an integer in 1..1048576"),
    ({"train_batch_size": 2**40}, "expected an integer <= 2147483647"),
    ({"fp16": {"initial_scale_power": 1000}}, "expected an integer in 0..64"),
    ({"seed": 2**64}, "expected an integer <= 18446744073709551615"),
])
def test_absurd_sizes_are_refused(raw: dict[str, Any], expected: str) -> None:
    (line,) = problems_of(raw)
    assert expected in line, line


@pytest.mark.parametrize(("raw", "path", "bound"), [
    ({"zero_optimization": {"reduce_bucket_size": 1e15}}, "zero_optimization.reduce_bucket_size", 10**12),
    ({"zero_optimization": {"stage3_max_live_parameters": 10**13}}, "zero_optimization.stage3_max_live_parameters",
     10**12),
    ({"zero_optimization": {"sub_group_size": 1e14}}, "zero_optimization.sub_group_size", 10**12),
    ({"comms": {"timeout": 1e12}}, "comms.timeout", 2592000.0),
])
def test_a_value_past_a_bound_that_means_no_limit_is_read_as_the_bound(raw: dict[str, Any], path: str,
                                                                       bound: float) -> None:
    # Issue 35: Hugging Face's own ds_config_zero3.json writes `sub_group_size: 1e14` (one sub-group), which
    # DeepSpeed accepts; these fields allocate nothing in proportion to their value, so it is not refused.
    config = Config.load(raw)
    value: Any = config.to_dict()
    for part in path.split("."):
        value = value[part]
    assert value == bound, value
    (note,) = [n for n in config.notes if n.path == path]
    assert "where it already means no limit here: read as" in note.message, note


# -------------------------------------------------------------------------- bounded output


def test_many_unknown_keys_list_twenty_and_count_the_rest() -> None:
    raw = {f"key_{i}": 1 for i in range(200_000)}
    start = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        Config.load(raw)
    seconds = time.perf_counter() - start
    message = str(info.value)
    assert len(info.value.problems) == 200_000 and seconds < 2.0, seconds
    assert message.count("\n  - ") == MAX_SHOWN and message.endswith("  ... and 199980 more (fix these first; "
                                                                     "`.problems` lists all)")
    assert len(message) < 5_000


def test_many_unknown_optimizer_params_are_cheap_too() -> None:
    raw = {"optimizer": {"type": "SGD", "params": {f"p{i}": 1 for i in range(50_000)}}}
    start = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        Config.load(raw)
    assert len(info.value.problems) == 50_000 and time.perf_counter() - start < 2.0
    assert len(str(info.value)) < 5_000


def test_a_long_key_or_value_is_cut_in_the_message() -> None:
    with pytest.raises(ConfigError) as info:
        Config.load({"k" * 100_000: 1, "zero_optimization": {"stage": [1] * 100_000}})
    assert len(str(info.value)) < 2_000


def test_python_dicts_that_nest_or_repeat_without_end_are_refused() -> None:
    cyclic: dict[str, Any] = {}
    cyclic["optimizer"] = cyclic
    with pytest.raises(ConfigError, match="nests deeper than 32 levels"):
        Config.load(cyclic)
    level: Any = ["x"] * 10
    for _ in range(9):
        level = [level] * 10  # 10^10 values reached through shared lists
    with pytest.raises(ConfigError, match="reaches more than 500000 values"):
        Config.load({"optimizer": {"type": "Adam", "params": {"lr": 0.1, "bomb": level}}})


# -------------------------------------------------------------------------- what still works


def test_yaml_anchors_within_the_bound_and_merge_keys_work(tmp_path: Path) -> None:
    path = tmp_path / "engines.yaml"
    path.write_text("engines:\n  teacher: &base\n    zero_optimization: {stage: 1}\n    train_batch_size: 8\n"
                    "  student:\n    <<: *base\n    train_batch_size: 4\n")
    configs = load_configs(path)
    assert configs["student"].zero_optimization.stage == 1 and configs["student"].train_batch_size == 4
    assert configs["teacher"].train_batch_size == 8


def test_hf_auto_values_still_resolve() -> None:
    config = Config.load({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                          "zero_optimization": {"stage": "auto", "reduce_bucket_size": "auto"}})
    assert config.zero_optimization.stage == 0 and "zero_optimization.reduce_bucket_size" in config.pending
