"""An image classifier trained the way DeepSpeedExamples' CIFAR-10 script trains one.

It is written as a DeepSpeed client script; only the two imports below name shardwise:

    shardwise run --nproc-per-node 2 examples/deepspeed/train_classifier.py \
        --deepspeed --deepspeed_config examples/deepspeed/classifier_stage0.json

(`torchrun` works too.) The data are synthetic 3x8x8 "images" whose class is their brightest
colour channel, so the script needs no download and the loss visibly falls.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise.deepspeed as deepspeed  # was: import deepspeed
from shardwise.deepspeed.accelerator import get_accelerator  # was: from deepspeed.accelerator import ...


def add_argument(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="classifier")
    parser.add_argument("-e", "--epochs", default=3, type=int, help="number of total epochs")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--log-interval", type=int, default=4, help="output logging information at a given interval")
    parser.add_argument("--samples", type=int, default=256, help="size of the synthetic training set")
    parser.add_argument("--save-dir", type=str, default="checkpoints/classifier", help="where checkpoints go")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def synthetic_images(samples: int, seed: int = 1234) -> torch.utils.data.TensorDataset:
    """Noisy images whose class is their brightest colour channel (3 classes)."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 3, (samples,), generator=generator)
    images = torch.randn(samples, 3, 8, 8, generator=generator)
    images[torch.arange(samples), labels] += 0.5
    return torch.utils.data.TensorDataset(images, labels)


class Net(nn.Module):
    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(16 * 2 * 2, 32)
        self.fc2 = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        return self.fc2(F.relu(self.fc1(x)))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = add_argument(argv)
    deepspeed.init_distributed()
    # DeepSpeedExamples branch on -1 for "not launched": under torchrun, LOCAL_RANK fills it.
    distributed = args.local_rank != -1

    torch.manual_seed(0)
    trainset = synthetic_images(args.samples)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset)

    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half

    criterion = nn.CrossEntropyLoss()
    losses: list[float] = []
    for epoch in range(args.epochs):
        trainloader.sampler.set_epoch(epoch)
        running_loss = 0.0
        for i, (inputs, labels) in enumerate(trainloader):
            inputs, labels = inputs.to(local_device), labels.to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs.float(), labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
            running_loss += loss.item()
            if local_rank == 0 and i % args.log_interval == args.log_interval - 1:
                print(f"[{epoch + 1 : d}, {i + 1 : 5d}] loss: {running_loss / args.log_interval : .3f}")
                running_loss = 0.0

    client_state = {"epoch": args.epochs, "note": "saved by train_classifier"}
    model_engine.save_checkpoint(args.save_dir, client_state=client_state)
    _, restored = model_engine.load_checkpoint(args.save_dir)
    weights = {k: v.clone() for k, v in model_engine.full_state_dict().items()}
    if local_rank == 0:
        print("Finished Training; resumed from epoch", restored["epoch"])
    return {"distributed": distributed, "local_rank": local_rank, "losses": losses, "client_state": restored,
            "weights": weights, "world_size": model_engine.world_size}


if __name__ == "__main__":
    main()
