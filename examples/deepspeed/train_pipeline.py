"""An AlexNet-like classifier trained pipelined, the way DeepSpeedExamples' pipeline script trains AlexNet.

It is written as a DeepSpeed client script; only the three imports below name shardwise:

    shardwise run --nproc-per-node 2 examples/deepspeed/train_pipeline.py \
        --deepspeed_config examples/deepspeed/pipeline.json

The model's layers are cut into 2 stages by parameter count (DeepSpeed's `partition_method`),
and `engine.train_batch()` draws its micro-batches from the `training_data` given to `initialize`
(in order, repeating). The data are synthetic CIFAR-shaped images (3x32x32, 10 classes), so the
script needs no download. The config sets no `gradient_clipping`, so, as under DeepSpeed, the
gradients are clipped to norm 1.0.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import shardwise.deepspeed as deepspeed  # was: import deepspeed
from shardwise.deepspeed.pipe import PipelineModule  # was: from deepspeed.pipe import PipelineModule
from shardwise.deepspeed.utils import RepeatingLoader  # was: from deepspeed.utils import RepeatingLoader


def get_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("-s", "--steps", type=int, default=6, help="quit after this many steps")
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2, help="pipeline parallelism")
    parser.add_argument("--dropout", type=float, default=0.5, help="dropout of the classifier")
    parser.add_argument("--samples", type=int, default=40, help="size of the synthetic training set")
    parser.add_argument("--seed", type=int, default=1138, help="PRNG seed")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def synthetic_cifar(samples: int, seed: int = 7) -> torch.utils.data.TensorDataset:
    """CIFAR-shaped images whose class shifts their mean, so the loss can fall."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (samples,), generator=generator)
    images = torch.randn(samples, 3, 32, 32, generator=generator) + (labels.float() / 10).view(-1, 1, 1, 1)
    return torch.utils.data.TensorDataset(images, labels)


class AlexNet(nn.Module):
    """AlexNet's shape (5 convolutions, 3 pools, a 3-layer classifier), sized for 32x32 images."""

    def __init__(self, num_classes: int = 10, dropout: float = 0.5) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, kernel_size=3, stride=2, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, kernel_size=3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(32, 48, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(48, 32, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(32, 32, kernel_size=3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout), nn.Linear(32 * 2 * 2, 256), nn.ReLU(inplace=True),
            nn.Dropout(p=dropout), nn.Linear(256, 128), nn.ReLU(inplace=True), nn.Linear(128, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def join_layers(vision_model: AlexNet) -> list[Any]:
    return [*vision_model.features, vision_model.avgpool, lambda x: torch.flatten(x, 1), *vision_model.classifier]


def train_pipe(args: argparse.Namespace, part: str = "parameters") -> dict[str, Any]:
    torch.manual_seed(args.seed)
    deepspeed.runtime.utils.set_random_seed(args.seed)
    net = AlexNet(num_classes=10, dropout=args.dropout)
    net = PipelineModule(layers=join_layers(net), loss_fn=torch.nn.CrossEntropyLoss(),
                         num_stages=args.pipeline_parallel_size, partition_method=part,
                         activation_checkpoint_interval=0)
    trainset = synthetic_cifar(args.samples)
    engine, _, loader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=trainset)
    losses = [float(engine.train_batch()) for _ in range(args.steps)]
    # An evaluation pass over the next micro-batches of the same repeating loader.
    eval_loss = float(engine.eval_batch(RepeatingLoader(torch.utils.data.DataLoader(trainset, batch_size=4))))
    return {"losses": losses, "eval_loss": eval_loss, "parts": net.parts, "weights": engine.full_state_dict(),
            "loader": type(loader).__name__, "stage": net.stage_id}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = get_args(argv)
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    args.local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(args.local_rank)
    return train_pipe(args)


if __name__ == "__main__":
    main()
