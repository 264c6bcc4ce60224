"""A GAN: two trained engines, each with its own stage and precision, from one config file.

    shardwise run --nproc-per-node 2 examples/gan.py

The generator (bf16, ZeRO-1) learns to draw points from a ring of eight
Gaussians; the discriminator (fp32, ZeRO-3) learns to tell its points from
real ones.  The generator's loss flows through the discriminator's parameters,
as in any GAN: the discriminator's engine keeps those gradients out of its own
reduction, and ``zero_grad`` drops them before its next step.  Progress is the
mean distance from generated points to the nearest mode, which falls as the
generator learns.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwise

CONFIG = Path(__file__).resolve().parent / "configs" / "engines" / "gan.yaml"
MODES = torch.tensor([[math.cos(2 * math.pi * k / 8), math.sin(2 * math.pi * k / 8)] for k in range(8)]) * 2.0


def real_points(n: int, gen: torch.Generator) -> torch.Tensor:
    centers = MODES[torch.randint(0, 8, (n,), generator=gen)]
    return centers + 0.05 * torch.randn(n, 2, generator=gen)


def mlp(inputs: int, outputs: int, width: int = 64) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inputs, width), nn.LeakyReLU(0.2), nn.Linear(width, width), nn.LeakyReLU(0.2),
                         nn.Linear(width, outputs))


def distance_to_modes(points: torch.Tensor) -> float:
    return float(torch.cdist(points.float(), MODES).min(dim=1).values.mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(CONFIG))
    p.add_argument("--steps", type=int, default=400)
    args = p.parse_args()
    shardwise.init_distributed()
    torch.manual_seed(0)
    configs = shardwise.load_configs(args.config)
    gen = shardwise.initialize(mlp(8, 2), config=configs["generator"], name="generator")
    disc = shardwise.initialize(mlp(2, 1), config=configs["discriminator"], name="discriminator")
    batch = gen.train_micro_batch_size_per_gpu()
    data = torch.Generator().manual_seed(1000 + dist.get_rank())
    noise = torch.Generator().manual_seed(2000 + dist.get_rank())
    probe = torch.randn(512, 8, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        start = distance_to_modes(gen(probe))

    for step in range(args.steps):
        real, z = real_points(batch, data), torch.randn(batch, 8, generator=noise)
        fake = gen(z)
        real_logits, fake_logits = disc(real), disc(fake.detach().float())
        d_loss = F.binary_cross_entropy_with_logits(real_logits, torch.ones_like(real_logits)) + \
            F.binary_cross_entropy_with_logits(fake_logits, torch.zeros_like(fake_logits))
        disc.backward(d_loss)
        disc.step()

        fooled = disc(fake.float())
        g_loss = F.binary_cross_entropy_with_logits(fooled, torch.ones_like(fooled))
        gen.backward(g_loss)  # reaches the discriminator's parameters too...
        gen.step()
        disc.zero_grad()  # ...so drop those before the discriminator's next step
        if dist.get_rank() == 0 and (step % 100 == 0 or step == args.steps - 1):
            print(f"step {step + 1:4d} | D {d_loss.item():.3f} | G {g_loss.item():.3f}", flush=True)

    with torch.no_grad():
        end = distance_to_modes(gen(probe))
    if dist.get_rank() == 0:
        print(f"mean distance of generated points to the nearest mode: {start:.3f} -> {end:.3f}", flush=True)
    gen.destroy()
    disc.destroy()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
