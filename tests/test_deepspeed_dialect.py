"""`shardwise.deepspeed`'s own defaults and modules, in one process (the 2-rank clients are in
test_deepspeed_clients.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import shardwise
import shardwise.deepspeed as deepspeed
from shardwise.config import Config
from shardwise.deepspeed.defaults import apply_defaults
from shardwise.deepspeed.pipe import PipeDataParallelTopology, PipelineModule, PipeModelDataParallelTopology
from shardwise.deepspeed.runtime.utils import partition_balanced, partition_uniform
from shardwise.deepspeed.utils import RepeatingLoader
from shardwise.pipe.partition import partition

#: torchvision's AlexNet(num_classes=10) as DeepSpeedExamples' `join_layers` lists it: trainable
#: parameters per layer (features, avgpool, flatten, classifier)
ALEXNET = [23296, 0, 0, 307392, 0, 0, 663936, 0, 884992, 0, 590080, 0, 0, 0, 0, 0, 37752832, 0, 0, 16781312, 0, 40970]


def test_parameters_partition_splits_as_deepspeed() -> None:
    assert partition(["x"] * 22, ALEXNET.__getitem__, 2, "parameters") == [0, 19, 22]  # DeepSpeed 0.19: 19
    # DeepSpeed keeps the least spread (heaviest - lightest), a tie going to the later cut.
    assert partition_balanced([5, 1, 1, 1, 1, 1, 5], 3) == [0, 1, 6, 7]
    assert partition_balanced([4, 1, 1, 1, 2, 3], 3) == [0, 2, 5, 6]  # 5/4/3 ties [0, 1, 4, 6]'s 4/3/5: later cut
    assert partition_balanced([1, 0, 0, 0, 1], 2) == [0, 4, 5]  # weightless layers go to the earlier stage
    assert partition_balanced([3, 3], 2) == [0, 1, 2] and partition_uniform(2, 3) == [0, 1, 2, 2]
    assert partition_uniform(7, 3) == [0, 3, 5, 7]


def test_defaults_apply_only_where_the_config_is_silent() -> None:
    given = Config.load({"gradient_clipping": 0.5, "checkpoint": {"save_rng_state": True},
                         "optimizer": {"type": "Adam", "params": {"lr": 0.1, "weight_decay": 0.2}}})
    kept, _ = apply_defaults(given, client_optimizer=False)
    assert kept == given
    silent, choices = apply_defaults(Config.load({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}), False)
    assert silent.gradient_clipping == 1.0 and not silent.checkpoint.save_rng_state
    assert silent.optimizer is not None and silent.optimizer.params == {"lr": 0.1, "weight_decay": 0.0}
    assert len(choices) == 4
    # `shardwise.initialize` keeps plain PyTorch's defaults.
    plain = Config.load({})
    assert plain.gradient_clipping == 0.0 and plain.checkpoint.save_rng_state


def test_client_optimizer_wins_and_backwards_accumulate(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model, twin = nn.Linear(3, 1), nn.Linear(3, 1)
    twin.load_state_dict(model.state_dict())
    config = {"train_batch_size": 2, "gradient_clipping": 0.0,
              "optimizer": {"type": "Adam", "params": {"lr": 0.5}}}
    with caplog.at_level(logging.INFO, logger="shardwise"):
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                       config=config)
    assert "config's `optimizer` section (`Adam`) is ignored" in caplog.text
    assert isinstance(optimizer.inner, torch.optim.SGD)
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    engine.backward(engine(x).sum())
    engine.backward(engine(y).square().sum())  # DeepSpeed accumulates; shardwise.initialize refuses
    assert engine.step()
    (twin(x).sum() + twin(y).square().sum()).backward()
    torch.optim.SGD(twin.parameters(), lr=0.1).step()
    for got, want in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)  # fp32, one process: float noise
    plain = shardwise.initialize(nn.Linear(3, 1), config={"train_batch_size": 2, "optimizer": {"type": "SGD",
                                                                                              "params": {"lr": 0.1}}})
    plain.backward(plain(x).sum())
    with pytest.raises(RuntimeError, match="called again at an accumulation boundary"):
        plain.backward(plain(y).sum())


def test_imports_scripts_use() -> None:
    from shardwise.deepspeed.runtime.dataloader import RepeatingLoader as AlsoRepeating
    from shardwise.deepspeed.utils import groups, log_dist, logger

    assert AlsoRepeating is RepeatingLoader and logger.name == "shardwise" and callable(log_dist)
    assert groups.get_model_parallel_world_size() == 1
    deepspeed.runtime.utils.set_random_seed(5)
    first = torch.rand(1)
    deepspeed.runtime.utils.set_random_seed(5)
    assert torch.equal(first, torch.rand(1))
    assert [x for _, x in zip(range(5), RepeatingLoader([1, 2]))] == [1, 2, 1, 2, 1]
    with pytest.raises(StopIteration):
        next(RepeatingLoader([]))
    topo = PipeDataParallelTopology(num_pp=2, num_dp=2)
    assert (topo.get_dim("pipe"), topo.get_rank(pipe=1, data=0), topo.get_axis_list("pipe", 1)) == (2, 2, [2, 3])
    with pytest.raises(ValueError, match="2 model-parallel ranks"):
        PipelineModule([nn.Linear(2, 2)], topology=PipeModelDataParallelTopology(1, 2, 1))
    with pytest.raises(ValueError, match="needs `num_stages` or `topology`"):
        PipelineModule([nn.Linear(2, 2)])
    assert PipelineModule([nn.Linear(2, 2)], topology=PipeDataParallelTopology(1, 1)).num_stages == 1
