"""Train a small byte-level GPT with shardwise.

One process::

    python examples/train_gpt.py --size tiny --steps 50

Two ranks on one machine (any ZeRO stage; pick it with the config)::

    shardwise run --nproc-per-node 2 examples/train_gpt.py --config examples/configs/stage3.yaml

The model (``gpt.py``) and data (``data.py``) are plain PyTorch; everything
distributed goes through the public shardwise API: ``init_distributed``,
``initialize``, and the engine's forward / backward / step.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import shardwise

# The model and data live next to this script (its folder is on sys.path when run).
from data import batches, decode, encode, load_bytes
from gpt import GPT, gpt_config, preset_names

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "stage2.yaml"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="shardwise config (.yaml/.json)")
    parser.add_argument("--size", default="small", choices=preset_names(), help="GPT preset")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--data", default=None, help="a text file (default: Python's stdlib source)")
    parser.add_argument("--data-bytes", type=int, default=2_000_000, help="read at most this many bytes")
    parser.add_argument("--seed", type=int, default=0, help="seeds the model init, batches and sampling")
    parser.add_argument("--sample-tokens", type=int, default=200, help="bytes to generate at the end (0: none)")
    parser.add_argument("--prompt", default="def ", help="text the sample starts from")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0: greedy)")
    parser.add_argument("--log-every", type=int, default=None,
                        help="steps between logs (default: the config's steps_per_print)")
    parser.add_argument("--max-seconds", type=float, default=None, help="stop training after this many seconds")
    return parser.parse_args(argv)


def log(message: str) -> None:
    """Print on rank 0 only, so a multi-rank run shows each line once."""
    if dist.get_rank() == 0:
        print(message, flush=True)


def mean_over_ranks(value: torch.Tensor) -> float:
    """The average of a scalar across ranks (a collective: every rank calls it)."""
    total = value.detach().float().reshape(1).clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def out_of_time(start: float, limit: float | None, device: torch.device) -> bool:
    """Whether any rank passed ``limit`` seconds; all ranks get the same answer, so none hangs."""
    if limit is None:
        return False
    late = torch.tensor([float(time.perf_counter() - start > limit)], device=device)
    dist.all_reduce(late, op=dist.ReduceOp.MAX)
    return bool(late.item())


@dataclass
class Job:
    """What every training step needs: the engine, the text, and this rank's share of the batch."""

    engine: shardwise.Engine
    data: torch.Tensor
    rank: int
    world: int
    micro: int
    accumulation: int
    block: int
    device: torch.device

    @property
    def tokens_per_step(self) -> int:
        """Tokens all ranks together train on in one optimizer step."""
        return self.micro * self.accumulation * self.world * self.block


def setup(args: argparse.Namespace) -> Job:
    """Join the process group, build the GPT and its engine, load the text."""
    shardwise.init_distributed()
    torch.manual_seed(args.seed)  # every rank builds the same model (the engine also syncs it)
    model = GPT(gpt_config(args.size))
    engine = shardwise.initialize(model, config=args.config)
    world = dist.get_world_size()
    sizes = engine.config.batch_sizes(world)
    if sizes.micro_batch_size is None:
        raise SystemExit(
            f"{args.config} sets no batch size; add `train_micro_batch_size_per_gpu` (or `train_batch_size`)"
        )
    job = Job(
        engine=engine, data=load_bytes(args.data, args.data_bytes), rank=dist.get_rank(), world=world,
        micro=sizes.micro_batch_size, accumulation=sizes.gradient_accumulation_steps,
        block=model.config.block_size, device=next(engine.module.parameters()).device,
    )
    log(describe(job, args.size, model.num_parameters()))
    return job


def describe(job: Job, size: str, params: int) -> str:
    """One line on the model, the parallel setup and the data."""
    cfg = job.engine.config
    precision = "bf16" if cfg.bf16.enabled else "fp16" if cfg.fp16.enabled else "fp32"
    return (
        f"GPT {size}: {params:,} params | {job.world} rank(s), ZeRO stage {cfg.zero_optimization.stage}, "
        f"{precision} | micro batch {job.micro} x accumulation {job.accumulation} x block {job.block} | "
        f"{job.data.numel():,} bytes of text"
    )


def train_step(job: Job, step: int, seed: int) -> torch.Tensor:
    """One optimizer step (``accumulation`` micro batches); returns the last micro batch's loss."""
    for micro_step in range(job.accumulation):
        # Each micro batch has its own index, so accumulation sees new data.
        x, y = batches(job.data, job.micro, job.block, rank=job.rank, world_size=job.world, seed=seed,
                       step=step * job.accumulation + micro_step)
        _, loss = job.engine(x.to(job.device), y.to(job.device))
        job.engine.backward(loss)
        job.engine.step()
    return loss


def sample(job: Job, args: argparse.Namespace) -> str:
    """Generate from ``args.prompt`` (every rank runs it: stage 3 gathers weights collectively)."""
    job.engine.eval()
    torch.manual_seed(args.seed)  # same seed on every rank: same sample everywhere
    prompt = encode(args.prompt)[None].to(job.device)
    out = job.engine.generate(prompt, max_new_tokens=args.sample_tokens, temperature=args.temperature)
    job.engine.train()
    return decode(out[0].cpu())


def train(args: argparse.Namespace) -> float:
    """Run the job; returns the last logged loss (averaged over ranks)."""
    job = setup(args)
    every = args.log_every or job.engine.config.steps_per_print
    start = last_time = time.perf_counter()
    loss_value, last_logged = float("nan"), 0
    for step in range(1, args.steps + 1):
        loss = train_step(job, step - 1, args.seed)
        stop = out_of_time(start, args.max_seconds, job.device)
        if step == 1 or step % every == 0 or step == args.steps or stop:
            loss_value = mean_over_ranks(loss)
            now = time.perf_counter()
            rate = job.tokens_per_step * (step - last_logged) / (now - last_time)
            log(f"step {step:5d} | loss {loss_value:.4f} | lr {job.engine.get_lr()[0]:.2e} | {rate:,.0f} tokens/s")
            last_time, last_logged = now, step
        if stop:
            log(f"stopping after {step} steps: --max-seconds {args.max_seconds:g} reached")
            break
    log(f"trained {job.engine.global_steps} steps in {time.perf_counter() - start:.1f}s; final loss {loss_value:.4f}")
    if args.sample_tokens > 0:
        text = sample(job, args)
        log(f"--- sample ({args.sample_tokens} bytes, temperature {args.temperature:g}) ---\n{text}\n---")
    return loss_value


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        train(args)
        # Every rank finishes its last collective before any rank tears the group down:
        # a rank that destroys gloo while a peer still exchanges with it can abort at exit.
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
