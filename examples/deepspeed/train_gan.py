"""A small DCGAN trained the way DeepSpeedExamples' GAN script trains one: two engines, one process each.

It is written as a DeepSpeed client script; only the import below names shardwise:

    shardwise run --nproc-per-node 2 examples/deepspeed/train_gan.py --deepspeed_config examples/deepspeed/gan.json

As in DeepSpeedExamples, the optimizers are the script's own (the config's `optimizer` section is
ignored, with a warning), the discriminator takes two `backward` calls (real, then fake) before one
`step`, and the generator's loss flows through the discriminator. The "images" are synthetic 3x8x8
blobs, so the script needs no download.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from typing import Any

import numpy
import torch
import torch.nn as nn
import torch.utils.data

import shardwise.deepspeed as deepspeed  # was: import deepspeed


def get_argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batchSize", type=int, default=16, help="input batch size")
    parser.add_argument("--nz", type=int, default=8, help="size of the latent z vector")
    parser.add_argument("--ngf", type=int, default=8)
    parser.add_argument("--ndf", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=2, help="number of epochs to train for")
    parser.add_argument("--lr", type=float, default=0.0002, help="learning rate")
    parser.add_argument("--beta1", type=float, default=0.5, help="beta1 for adam")
    parser.add_argument("--manualSeed", type=int, default=999, help="manual seed")
    parser.add_argument("--samples", type=int, default=64, help="size of the synthetic data set")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    return parser


def set_seed(value: int) -> None:
    random.seed(value)
    numpy.random.seed(value)
    torch.manual_seed(value)


def synthetic_images(samples: int, seed: int = 11) -> torch.utils.data.TensorDataset:
    """Bright squares on a dark background, in [-1, 1] like normalised images."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.full((samples, 3, 8, 8), -0.8)
    corners = torch.randint(0, 5, (samples, 2), generator=generator)
    for index, (row, col) in enumerate(corners.tolist()):
        images[index, :, row : row + 3, col : col + 3] = 0.8
    return torch.utils.data.TensorDataset(images + 0.05 * torch.randn(images.shape, generator=generator))


class Generator(nn.Module):
    def __init__(self, ngf: int, nc: int, nz: int) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, nc, 4, 2, 1, bias=False), nn.Tanh(),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self, ndf: int, nc: int) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, 1, 4, 1, 0, bias=False), nn.Sigmoid(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x).view(-1, 1).squeeze(1)


def weights_init(m: nn.Module) -> None:
    if "Conv" in type(m).__name__:
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif "BatchNorm" in type(m).__name__:
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)


def train(args: argparse.Namespace) -> dict[str, Any]:
    set_seed(args.manualSeed)
    dataset = synthetic_images(args.samples)
    # As in DeepSpeedExamples: a plain shuffled loader, seeded alike on every rank.
    dataloader = torch.utils.data.DataLoader(dataset, batch_size=args.batchSize, shuffle=True)
    device = torch.device("cpu")
    netG = Generator(args.ngf, 3, args.nz).to(device)
    netG.apply(weights_init)
    netD = Discriminator(args.ndf, 3).to(device)
    netD.apply(weights_init)
    criterion = nn.BCELoss()
    real_label, fake_label = 1.0, 0.0
    optimizerD = torch.optim.Adam(netD.parameters(), lr=args.lr, betas=(args.beta1, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=args.lr, betas=(args.beta1, 0.999))
    model_engineD, optimizerD, _, _ = deepspeed.initialize(args=args, model=netD, model_parameters=netD.parameters(),
                                                           optimizer=optimizerD)
    model_engineG, optimizerG, _, _ = deepspeed.initialize(args=args, model=netG, model_parameters=netG.parameters(),
                                                           optimizer=optimizerG)
    losses = []
    for _ in range(args.epochs):
        for (real,) in dataloader:
            # (1) Update D: maximize log(D(x)) + log(1 - D(G(z)))
            netD.zero_grad()
            label = torch.full((real.size(0),), real_label, dtype=real.dtype, device=device)
            errD_real = criterion(netD(real), label)
            model_engineD.backward(errD_real)
            noise = torch.randn(real.size(0), args.nz, 1, 1, device=device)
            fake = netG(noise)
            label.fill_(fake_label)
            errD_fake = criterion(netD(fake.detach()), label)
            model_engineD.backward(errD_fake)
            model_engineD.step()
            # (2) Update G: maximize log(D(G(z)))
            netG.zero_grad()
            label.fill_(real_label)
            errG = criterion(netD(fake), label)
            model_engineG.backward(errG)
            model_engineG.step()
            losses.append(((errD_real + errD_fake).item(), errG.item()))
    return {"losses": losses, "D": model_engineD.full_state_dict(), "G": model_engineG.full_state_dict()}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = get_argument_parser()
    parser = deepspeed.add_config_arguments(parser)
    return train(parser.parse_args(argv))


if __name__ == "__main__":
    main()
