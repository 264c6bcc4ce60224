"""A small language model trained the way DeepSpeedExamples' language-model scripts train one.

It is written as a DeepSpeed client script; only the imports below name shardwise:

    shardwise run --nproc-per-node 2 examples/deepspeed/train_lm.py \
        --deepspeed --deepspeed_config examples/deepspeed/lm_stage3.json

The configs (`lm_stage0.json`, `lm_stage3.json`) are in the Hugging Face style, with `"auto"`
values that shardwise settles from what `initialize` receives: the model's dtype and hidden size,
and the learning-rate schedule the script passes, to which the config's all-`auto` scheduler gives
way. Under ZeRO stage 3 the model is built partitioned
(`deepspeed.zero.Init`). The text is this file's own source, read as bytes.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

import shardwise.deepspeed as deepspeed  # was: import deepspeed
from shardwise.deepspeed import comm as dist  # was: from deepspeed import comm as dist
from shardwise.deepspeed.accelerator import get_accelerator  # was: from deepspeed.accelerator import ...


def get_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="byte-level language model")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per micro-batch on each rank")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--output-dir", type=str, default="checkpoints/lm")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


class ModelConfig:
    """Carries `hidden_size`, which the config's `auto` bucket sizes are computed from."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size


class TinyLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.mix = nn.GRU(config.hidden_size, config.hidden_size, batch_first=True)
        self.head = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.mix(self.embed(tokens))
        logits = self.head(hidden).float()
        return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def batches(seq_len: int, batch_size: int, rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed windows of this file's bytes; rank r takes every world-th window."""
    data = torch.tensor(list(Path(__file__).read_bytes()), dtype=torch.long)
    starts = list(range(0, data.numel() - seq_len - 1, seq_len))[rank::world]
    windows = [data[s: s + seq_len + 1] for s in starts]

    def collate(group: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        stacked = torch.stack(group)
        return stacked[:, :-1], stacked[:, 1:]

    return [collate(windows[i: i + batch_size]) for i in range(0, len(windows) - batch_size + 1, batch_size)]


def warmup_then_cosine(total_steps: int) -> Any:
    def schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / 2) * 0.5 * (1 + math.cos(math.pi * step / total_steps)))

    return schedule


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = get_args(argv)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    ds_config = json.loads(Path(args.deepspeed_config).read_text())
    torch.manual_seed(0)
    zero_stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    with deepspeed.zero.Init(config_dict_or_path=ds_config, enabled=zero_stage == 3):
        model = TinyLM(ModelConfig(vocab_size=256, hidden_size=args.hidden))

    engine, optimizer, _, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(),
        lr_scheduler=warmup_then_cosine(args.steps), dist_init_required=True)
    device = get_accelerator().device_name(engine.local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = batches(args.seq_len, args.batch_size, rank, world)

    losses: list[float] = []
    micro = 0
    while engine.global_steps < args.steps:
        tokens, targets = data[micro % len(data)]
        loss = engine(tokens.to(device), targets.to(device))
        engine.backward(loss)
        engine.step()
        micro += 1
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)

    engine.save_checkpoint(args.output_dir, client_state={"step": engine.global_steps})
    path, client_state = engine.load_checkpoint(args.output_dir)
    engine.save_16bit_model(args.output_dir, "model.safetensors")
    dist.barrier()
    if rank == 0:
        print(f"step {engine.global_steps}: loss {losses[-1]:.3f}; lr {scheduler.get_last_lr()}; saved {path}")
    return {"losses": losses, "client_state": client_state, "lr": engine.get_lr(), "config": engine.config.to_dict(),
            "scheduler": type(scheduler).__name__, "optimizer": type(optimizer.inner).__name__,
            "weights": {k: v.clone() for k, v in engine.full_state_dict().items()}, "local_rank": args.local_rank}


if __name__ == "__main__":
    main()
