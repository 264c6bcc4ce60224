"""Train the byte-level GPT of gpt.py with PyTorch Lightning's Trainer on a shardwise engine.

Two CPU ranks, ZeRO stage 3 (the model is built already partitioned, in ``configure_model``)::

    shardwise run --nproc-per-node 2 examples/lightning_gpt.py
    shardwise run --nproc-per-node 2 examples/lightning_gpt.py --stage 2 --precision bf16-mixed

``python examples/lightning_gpt.py`` works too: Lightning then starts the second rank itself.
The one line a DeepSpeed user changes is the strategy: ``ShardwiseStrategy(stage=3)`` where it said
``"deepspeed_stage_3"``. The run ends by saving a checkpoint directory (``last.ckpt``; running the
command again resumes from it, ``--steps`` higher trains further), consolidating it into one file of
fp32 weights, loading that with ``LitGPT.load_from_checkpoint`` and sampling some text from it.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch

# The model and data live next to this script (its folder is on sys.path when run).
from data import TextWindows, decode, encode, load_bytes, split_text
from gpt import GPT, gpt_config, preset_names
from torch.utils.data import DataLoader

from shardwise.lightning import ShardwiseStrategy, convert_zero_checkpoint_to_fp32_state_dict


class LitGPT(L.LightningModule):
    """The GPT as a LightningModule: AdamW with linear warmup and cosine decay, stepped every optimizer step."""

    def __init__(self, size: str = "small", lr: float = 2e-3, warmup: int = 20, steps: int = 100,
                 seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: Optional[GPT] = None

    def configure_model(self) -> None:
        if self.model is None:  # Lightning calls this again for each fit/validate/...
            torch.manual_seed(self.hparams.seed)
            self.model = GPT(gpt_config(self.hparams.size))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, loss = self.model(*batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, loss = self.model(*batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        optimizer = torch.optim.AdamW(self.parameters(), lr=hp.lr, betas=(0.9, 0.95), weight_decay=0.01)

        def factor(step: int) -> float:
            if step < hp.warmup:
                return (step + 1) / hp.warmup
            progress = min(1.0, (step - hp.warmup) / max(1, hp.steps - hp.warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", choices=preset_names(), help="GPT preset")
    parser.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3), help="ZeRO stage")
    parser.add_argument("--precision", default="32-true", help="Lightning's precision flag, e.g. bf16-mixed")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps in all (a resumed run counts on)")
    parser.add_argument("--batch-size", type=int, default=16, help="windows per rank and micro-batch")
    parser.add_argument("--accumulate", type=int, default=1, help="Trainer(accumulate_grad_batches=...)")
    parser.add_argument("--devices", type=int, default=2, help="ranks when not launched by torchrun/shardwise run")
    parser.add_argument("--data-bytes", type=int, default=2_000_000, help="bytes of Python's stdlib source to read")
    parser.add_argument("--run-dir", default="runs/lightning-gpt", help="checkpoint and consolidated weights")
    parser.add_argument("--fresh", action="store_true", help="start over instead of resuming from last.ckpt")
    parser.add_argument("--sample-tokens", type=int, default=120, help="bytes to generate at the end (0: none)")
    parser.add_argument("--prompt", default="def ", help="text the sample starts from")
    return parser.parse_args(argv)


def loaders(args: argparse.Namespace, block_size: int) -> tuple[DataLoader[Any], DataLoader[Any]]:
    """Training windows (Lightning shards and shuffles them over the ranks) and held-out ones."""
    train_text, held_out_text = split_text(load_bytes(None, args.data_bytes))
    train = DataLoader(TextWindows(train_text, block_size), batch_size=args.batch_size, shuffle=True)
    return train, DataLoader(TextWindows(held_out_text, block_size), batch_size=args.batch_size)


def sample(weights: Path, args: argparse.Namespace) -> str:
    """Rank 0: the consolidated file as a plain LightningModule (no engine, no process group), and a sample."""
    model = LitGPT.load_from_checkpoint(weights).model
    torch.manual_seed(0)
    out = model.generate(encode(args.prompt)[None], max_new_tokens=args.sample_tokens, temperature=0.8)
    return decode(out[0])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    run = Path(args.run_dir)
    last = run / "last.ckpt"  # a directory: the engine's collective checkpoint, with Lightning's state in it
    if args.fresh and int(os.environ.get("RANK", "0")) == 0:
        shutil.rmtree(run, ignore_errors=True)
    module = LitGPT(args.size, steps=args.steps)
    train, held_out = loaders(args, gpt_config(args.size).block_size)
    trainer = L.Trainer(
        strategy=ShardwiseStrategy(stage=args.stage), accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", args.devices)), precision=args.precision,
        max_steps=args.steps, accumulate_grad_batches=args.accumulate, gradient_clip_val=1.0,
        val_check_interval=max(1, args.steps // 2), limit_val_batches=4, check_val_every_n_epoch=None,
        default_root_dir=str(run), logger=False, enable_checkpointing=False, enable_model_summary=False,
        num_sanity_val_steps=0)
    resume = last.is_dir() and not args.fresh
    trainer.fit(module, train, held_out, ckpt_path=str(last) if resume else None)
    engine = trainer.strategy.engine
    trainer.print(f"GPT {args.size}, {engine.world_size} ranks, ZeRO stage {engine.config.zero_optimization.stage}, "
                  f"{args.precision}: step {trainer.global_step}, "
                  f"val_loss {float(trainer.callback_metrics.get('val_loss', float('nan'))):.3f}")
    trainer.save_checkpoint(last)  # every rank writes its shard
    if trainer.is_global_zero:
        weights = run / "last-fp32.ckpt"
        convert_zero_checkpoint_to_fp32_state_dict(last, weights)
        trainer.print(f"{last}/ consolidated into {weights}")
        if args.sample_tokens > 0:
            trainer.print(f"--- sample from {weights.name} ---\n{sample(weights, args)}\n---")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
