"""Real-style DeepSpeed configs are never refused by a shardwise bound (issue 35).

tests/configs/real_style/ holds configs written for this test in the styles real projects use:
Hugging Face transformers' tests/deepspeed (explicit fp16 sections, `sub_group_size` past 1e13 for "one
sub-group", `"auto"` everywhere), LLaVA's zero2/zero3_offload scripts (`1e9` floats, the un-prefixed
`gather_16bit_weights_on_model_save`, `steps_per_print: 1e6`), Megatron-DeepSpeed's templates (`aio`,
`pipeline_read`, `zero_allow_untested_optimizer`, `prescale_gradients`) and DeepSpeedExamples' (NVMe
offload of both kinds, `bias_correction`, a disabled `tensorboard`). Each was checked, when written,
to be accepted by DeepSpeed 0.19.8's own `DeepSpeedConfig` (its "auto"s filled as the HF Trainer
would). Each must load, resolve on a CPU job and train a step through `shardwise.deepspeed`.

Before issue 35, `sub_group_size: 5e13` was refused ("expected an integer <= 1000000000000
(shardwise's bound, far above any real setting)"), and so was `bias_correction: true`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardwise.deepspeed as deepspeed
from shardwise.config import Config
from shardwise.testing import distributed_test

CORPUS = Path(__file__).parent / "configs" / "real_style"
FILES = sorted(p.name for p in CORPUS.glob("*.json"))


def _filled(name: str, folder: Path) -> dict[str, Any]:
    """The file's config with its NVMe folder under ``folder``, and what the HF Trainer fills in for `auto`
    where only a trainer knows (the batch size, the schedule's total steps)."""
    data: dict[str, Any] = json.loads((CORPUS / name).read_text().replace("/local_nvme", str(folder)))
    if data.get("train_micro_batch_size_per_gpu", "auto") == data.get("train_batch_size", "auto") == "auto":
        data["train_micro_batch_size_per_gpu"] = 2
    params = data.get("scheduler", {}).get("params", {})
    if params.get("total_num_steps") == "auto":
        params["total_num_steps"] = 100
    return data


def test_the_corpus_has_every_style() -> None:
    assert len(FILES) >= 8 and {f.split("_")[0] for f in FILES} == {"hf", "llava", "megatron", "dsexamples"}


@pytest.mark.parametrize("name", FILES)
def test_a_real_style_config_loads_without_a_problem(name: str) -> None:
    config = Config.load(CORPUS / name)
    assert config.zero_optimization.stage in (0, 1, 2, 3)


@distributed_test(world_size=1, timeout=240)
def test_every_real_style_config_trains_a_step_through_the_dialect(tmp_path: Path) -> None:
    for name in FILES:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        config = _filled(name, tmp_path / name)
        # a file without an `optimizer` section is used with the client's own (Megatron's, the HF Trainer's)
        own = None if "optimizer" in config else torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=own,
                                               config=config)
        dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float16 if engine.fp16_enabled() else None
        x = torch.randn(engine.train_micro_batch_size_per_gpu() or 2, 8)
        for _ in range(engine.gradient_accumulation_steps()):
            loss = engine(x.to(dtype) if dtype is not None else x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
        assert engine.global_steps == 1 and torch.isfinite(loss), (name, loss)
        engine.destroy()


def test_bias_correction_false_is_refused_as_what_torch_cannot_do() -> None:
    from shardwise.config import ConfigError

    with pytest.raises(ConfigError, match="bias_correction.*torch's Adam always applies"):
        Config.load({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}})
