"""ShardwiseStrategy's pieces in one process: its config (arguments, DeepSpeed files, the Trainer's facts), the
param-group bridge, the choice of Lightning package, and that `import shardwise` imports no Lightning."""

from __future__ import annotations

import subprocess
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shardwise.config import ConfigError
from shardwise.lightning import flavour
from shardwise.lightning.config import StrategyConfig, TrainerFacts
from shardwise.lightning.groups import GroupBridge

CONFIGS = Path(__file__).parent / "configs"
ROOT = Path(__file__).resolve().parents[1]


def _strategy(config: Any = None, stage: Any = None, offload: Any = None, **loss: Any) -> StrategyConfig:
    return StrategyConfig.from_arguments(config, stage, offload or {}, loss)


# ------------------------------------------------------------------------------ arguments and config
def test_arguments_fill_in_what_the_config_leaves_unsaid() -> None:
    assert _strategy().stage == 2  # DeepSpeedStrategy's default without a config
    assert _strategy({"zero_optimization": {"stage": 3}}).stage == 3
    assert _strategy({"zero_optimization": {"stage": 3}}, stage=3).stage == 3
    assert _strategy({"gradient_clipping": 1.0}).stage == 0  # a config's own default: DeepSpeed's (no ZeRO)
    assert _strategy({"gradient_clipping": 1.0}, stage=1).stage == 1
    offloaded = _strategy(stage=2, offload={"offload_optimizer": {"device": "cpu"}})
    assert offloaded.base().zero_optimization.offload_optimizer.device == "cpu"


@pytest.mark.parametrize("config, stage, offload, match", [
    ({"zero_optimization": {"stage": 3}}, 2, None, r"stage=2\) contradicts the config's `zero_optimization.stage: 3`"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}}, None,
     {"offload_optimizer": {"device": "cpu"}}, r"offload_optimizer=True, device 'cpu'\) contradicts"),
    ({"zero_optimization": {"stage": 7}}, None, None, "zero_optimization.stage"),  # validated when built
])
def test_contradictions_and_bad_configs_fail_when_the_strategy_is_built(config: Any, stage: Any, offload: Any,
                                                                        match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _strategy(config, stage, offload)


def test_precision_flags_map_onto_the_engine_sections() -> None:
    plain = _strategy(stage=2)
    assert not plain.for_run(TrainerFacts("32-true")).bf16.enabled
    for flag in ("bf16-mixed", "bf16-true"):
        config = plain.for_run(TrainerFacts(flag))
        assert config.bf16.enabled and not config.fp16.enabled
    fp16 = _strategy(stage=2, initial_scale_power=8, hysteresis=1).for_run(TrainerFacts("16-mixed"))
    assert fp16.fp16.enabled and fp16.fp16.initial_scale_power == 8 and fp16.fp16.hysteresis == 1
    with pytest.raises(ValueError, match=r"not '64-true'"):
        plain.for_run(TrainerFacts("64-true"))
    with pytest.raises(ConfigError, match=r"enables `bf16` but the Trainer runs `precision='32-true'`; set "
                                          r"`Trainer\(precision='bf16-mixed'\)`"):
        _strategy({"bf16": {"enabled": True}}).for_run(TrainerFacts("32-true"))
    with pytest.raises(ConfigError, match=r"\['initial_scale_power'\] contradict the config's `fp16` section"):
        _strategy({"fp16": {"initial_scale_power": 12}}, initial_scale_power=8).for_run(TrainerFacts("16-mixed"))


def test_accumulation_and_clipping_are_the_trainers() -> None:
    config = _strategy(stage=1).for_run(TrainerFacts("32-true", accumulate_grad_batches=4, gradient_clip_val=0.5))
    assert config.gradient_accumulation_steps == 1 and config.gradient_clipping == 0.5  # Lightning accumulates
    # unset on both sides: no clipping (DeepSpeed's dialect would clip at 1.0; DeepSpeedStrategy sets 0 too)
    assert _strategy(stage=1).for_run(TrainerFacts("32-true")).gradient_clipping == 0.0
    agreed = _strategy({"gradient_accumulation_steps": 2, "gradient_clipping": 0.5, "train_batch_size": 16,
                        "train_micro_batch_size_per_gpu": 4})
    config = agreed.for_run(TrainerFacts("32-true", 2, 0.5, world_size=2))
    assert (config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (4, 1)
    with pytest.raises(ConfigError, match=r"`gradient_accumulation_steps: 4` differs from `Trainer\(accumulate_grad_"
                                          r"batches=2\)`"):
        _strategy({"gradient_accumulation_steps": 4}).for_run(TrainerFacts("32-true", 2))
    with pytest.raises(ConfigError, match=r"train_batch_size 12 != train_micro_batch_size_per_gpu 4"):
        _strategy({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 4}).for_run(
            TrainerFacts("32-true", 2, world_size=2))
    with pytest.raises(ConfigError, match=r"`gradient_clipping: 1.0` differs from `Trainer\(gradient_clip_val=0.5\)`"):
        _strategy({"gradient_clipping": 1.0}).for_run(TrainerFacts("32-true", gradient_clip_val=0.5))


def test_deepspeed_config_files_work_unchanged() -> None:
    """Hugging Face's ZeRO-2 template (every `auto`) and a file of DeepSpeed knobs, as DeepSpeedStrategy takes them."""
    hf = StrategyConfig.from_arguments(str(CONFIGS / "hf_zero2_auto.json"), None, {}, {})
    config = hf.for_run(TrainerFacts("bf16-mixed", 2, 1.0, world_size=2))
    assert config.zero_optimization.stage == 2 and config.bf16.enabled and not config.fp16.enabled
    assert (config.gradient_accumulation_steps, config.gradient_clipping) == (1, 1.0)
    assert config.optimizer is not None and config.scheduler is not None  # built on the user's side at setup
    assert config.checkpoint.save_rng_state is False  # the DeepSpeed dialect's default
    knobs = StrategyConfig.from_arguments(str(CONFIGS / "knobs.json"), 2, {}, {})
    config = knobs.for_run(TrainerFacts("bf16-mixed", world_size=2))
    assert config.train_micro_batch_size_per_gpu == 4  # train_batch_size 8 over 2 ranks, no accumulation


# ------------------------------------------------------------------------------------- param groups
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(3, 4)
        self.head = nn.Linear(4, 2)


def _frozen_backbone() -> tuple[_Net, torch.optim.Optimizer]:
    net = _Net()
    net.backbone.requires_grad_(False)
    return net, torch.optim.AdamW(net.head.parameters(), lr=0.1, weight_decay=0.3)


def test_a_parameter_outside_the_optimizer_waits_inert_until_add_param_group() -> None:
    net, user = _frozen_backbone()
    schedule = torch.optim.lr_scheduler.StepLR(user, 1, 0.5)  # wraps the user's `step`, not the copy's
    bridge = GroupBridge(user, net)
    copy = bridge.engine_optimizer
    assert type(copy) is type(user) and copy is not user
    assert [g["params"] for g in copy.param_groups] == [list(net.head.parameters()),
                                                          [net.backbone.weight], [net.backbone.bias]]
    groups = copy.param_groups
    bridge.push(groups)
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [(0.1, 0.3), (0.0, 0.0), (0.0, 0.0)]
    copy.step()  # stepping the copy is not a step of the user's optimizer ...
    assert not getattr(user, "_opt_called", False)
    bridge.stepped()  # ... the engine says when it was one, so the schedule does not warn
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        schedule.step()
    net.backbone.requires_grad_(True)
    user.add_param_group({"params": list(net.backbone.parameters()), "lr": 0.02})
    bridge.push(groups)
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [(0.05, 0.3), (0.02, 0.3), (0.02, 0.3)]
    groups[0]["lr"] = 0.7  # a checkpoint restored the engine's groups: the user's take them back
    bridge.pull(groups)
    assert user.param_groups[0]["lr"] == 0.7


def test_groups_the_engine_cannot_follow_are_errors() -> None:
    net, user = _frozen_backbone()
    net.backbone.bias.requires_grad_(True)
    with pytest.raises(ValueError, match=r"\['backbone.bias'\] require grad but are in no param group"):
        GroupBridge(user, net)
    net, user = _frozen_backbone()
    with pytest.raises(ValueError, match="not parameters of the LightningModule"):
        GroupBridge(torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1), net)
    bridge = GroupBridge(user, net)
    user.param_groups[0]["params"].append(net.backbone.weight)
    with pytest.raises(RuntimeError, match="param group 0 of the optimizer holds other parameters"):
        bridge.push(bridge.engine_optimizer.param_groups)


# --------------------------------------------------------------------------------- which Lightning
def test_the_strategy_is_built_for_the_imported_package(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in flavour.PACKAGES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "pytorch_lightning", types.ModuleType("pytorch_lightning"))
    assert flavour.chosen() == "pytorch_lightning"
    monkeypatch.setitem(sys.modules, "lightning.pytorch", types.ModuleType("lightning.pytorch"))
    with pytest.raises(RuntimeError, match=r"Trainer\(strategy=\"shardwise_stage_3\"\)"):
        flavour.chosen()
    for name in flavour.PACKAGES:
        monkeypatch.delitem(sys.modules, name)
    assert flavour.chosen() == "lightning.pytorch"  # neither imported: the first installed


def test_importing_shardwise_imports_no_lightning() -> None:
    code = ("import sys, shardwise, shardwise.lightning\n"
            "found = sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', "
            "'lightning_fabric'))\n"
            "assert not found, found\n")
    done = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
