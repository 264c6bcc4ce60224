"""Train the GPT defined once as pipeline layers: pipelined, or as one plain module.

The model is a list of layer specs (``gpt_layers``): token embedding, position
embedding, blocks, final LayerNorm, and a head that reuses the token
embedding's weight (``TiedLayerSpec("wte", ...)`` at both ends).

Two pipeline stages on two ranks (1F1B; the tied embedding lives on both)::

    shardwise run --nproc-per-node 2 examples/train_gpt_pipe.py --stages 2

Four ranks: 2 stages × 2 data-parallel replicas, ZeRO-1 across the replicas::

    shardwise run --nproc-per-node 4 examples/train_gpt_pipe.py --stages 2 --zero 1

The same layers as one plain module (``to_sequential()``) at ZeRO-3, on the
same global batch::

    shardwise run --nproc-per-node 2 examples/train_gpt_pipe.py --sequential
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

# The model and data live next to this script (its folder is on sys.path when run).
from data import batches, load_bytes
from gpt import GPTBlock, GPTConfig, PositionEmbedding, TokenEmbedding, gpt_config, lm_head, lm_loss, preset_names
from torch import nn

import shardwise
from shardwise.pipe import LayerSpec, PipelineModule, TiedLayerSpec


def gpt_layers(cfg: GPTConfig) -> list[Any]:
    """The GPT of ``gpt.py`` as pipeline layers, with the output head tied to the token embedding."""
    return [
        TiedLayerSpec("wte", TokenEmbedding, cfg),
        LayerSpec(PositionEmbedding, cfg),
        *(LayerSpec(GPTBlock, cfg) for _ in range(cfg.n_layer)),
        LayerSpec(nn.LayerNorm, cfg.n_embd),
        TiedLayerSpec("wte", TokenEmbedding, cfg, forward_fn=lm_head),
    ]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", choices=preset_names(), help="GPT preset")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages (the world must be a multiple)")
    parser.add_argument("--sequential", action="store_true", help="train to_sequential() as one module instead")
    parser.add_argument("--zero", type=int, default=None, help="ZeRO stage (default: 1 pipelined, 3 sequential)")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch")
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches per step (per replica, pipelined)")
    parser.add_argument("--checkpoint-interval", type=int, default=0, help="activation checkpointing every N layers")
    parser.add_argument("--bf16", action="store_true", help="compute in bf16")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--data", default=None, help="a text file (default: Python's stdlib source)")
    parser.add_argument("--data-bytes", type=int, default=2_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    return parser.parse_args(argv)


def log(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


def config(args: argparse.Namespace, accumulation: int) -> dict[str, Any]:
    zero = args.zero if args.zero is not None else (3 if args.sequential else 1)
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.01}},
        "zero_optimization": {"stage": zero},
        "bf16": {"enabled": args.bf16},
    }


def micro_batches(data: torch.Tensor, args: argparse.Namespace, block: int, rank: int, world: int, accumulation: int,
                  first_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This data-parallel rank's micro-batches, step after step (both pipeline ends draw the same)."""
    step = first_step
    while True:
        for micro in range(accumulation):
            yield batches(data, args.micro_batch, block, rank=rank, world_size=world, seed=args.seed,
                          step=step * accumulation + micro)
        step += 1


def train_pipelined(args: argparse.Namespace, cfg: GPTConfig, data: torch.Tensor) -> tuple[float, float]:
    model = PipelineModule(gpt_layers(cfg), num_stages=args.stages, loss_fn=lm_loss, partition_method="type:Block",
                           activation_checkpoint_interval=args.checkpoint_interval, seed_layers=True)
    engine = shardwise.initialize(model, config=config(args, args.accumulation))
    replicas = engine.groups.topology.replicas
    held = sum(p.numel() for p in model.parameters())
    log(f"pipeline: {model.num_stages} stages x {replicas} replica(s), ZeRO-{engine.strategy.stage}; stage 0 runs "
        f"layers {list(model.stage_layers())} ({held:,} parameters here) | global batch {engine.train_batch_size()}")
    it = micro_batches(data, args, cfg.block_size, engine.groups.replica, replicas, args.accumulation)
    return run(args, lambda: engine.train_batch(it).item(), engine.train_batch_size() * cfg.block_size)


def train_sequential(args: argparse.Namespace, cfg: GPTConfig, data: torch.Tensor) -> tuple[float, float]:
    # The same layers as one module; the same global batch as the pipeline (its replicas' share of micro-batches).
    torch.manual_seed(args.seed)
    model = PipelineModule(gpt_layers(cfg), loss_fn=lm_loss, activation_checkpoint_interval=args.checkpoint_interval,
                           seed_layers=True).to_sequential()
    world = dist.get_world_size()
    accumulation = max(1, args.accumulation * (world // args.stages) // world)
    engine = shardwise.initialize(model, config=config(args, accumulation))
    log(f"sequential: to_sequential() on {world} rank(s), ZeRO-{engine.strategy.stage} | "
        f"{sum(p.numel() for p in model.parameters()):,} parameters | global batch {engine.train_batch_size()}")
    it = micro_batches(data, args, cfg.block_size, dist.get_rank(), world, accumulation)

    def step() -> float:
        total = torch.zeros(())
        for _ in range(accumulation):
            x, y = next(it)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float() / accumulation
        dist.all_reduce(total)
        return total.item() / world

    return run(args, step, engine.train_batch_size() * cfg.block_size)


def run(args: argparse.Namespace, step: Any, tokens_per_step: int) -> tuple[float, float]:
    """Train ``args.steps`` steps, logging on rank 0; returns the first and the last step's loss."""
    start = last = time.perf_counter()
    first = loss = float("nan")
    logged = 0
    for index in range(1, args.steps + 1):
        loss = step()
        first = loss if index == 1 else first
        if index == 1 or index % args.log_every == 0 or index == args.steps:
            now = time.perf_counter()
            log(f"step {index:5d} | loss {loss:.4f} | {tokens_per_step * (index - logged) / (now - last):,.0f} tokens/s")
            last, logged = now, index
    log(f"trained {args.steps} steps in {time.perf_counter() - start:.1f}s; final loss {loss:.4f}")
    return first, loss


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    shardwise.init_distributed()
    try:
        cfg = gpt_config(args.size)
        data = load_bytes(args.data, args.data_bytes)
        (train_sequential if args.sequential else train_pipelined)(args, cfg, data)
        dist.barrier()  # nobody tears the group down while a peer still exchanges
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
