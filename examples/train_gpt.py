"""Train a small byte-level GPT with shardwise.Trainer.

Two ranks on one machine (any ZeRO stage; pick it with the config)::

    shardwise run --nproc-per-node 2 examples/train_gpt.py
    shardwise run --nproc-per-node 2 examples/train_gpt.py --config examples/configs/stage3.yaml

One process: ``python examples/train_gpt.py --size tiny --steps 50``.

The run directory (``runs/gpt-SIZE`` by default) gets the checkpoints, the
metrics (``metrics.jsonl``, one JSON line per logged step), the loss curves
(``metrics.png``) and ``model.json``, which ``shardwise generate`` reads::

    shardwise generate runs/gpt-small/checkpoints --trust-model-source --prompt "def "

``model.json`` names this folder's ``gpt.py`` as the model's source: a Python
file, which ``shardwise generate`` runs only when ``--trust-model-source`` says
that you trust it (it is this example's own file).

Running the same command again resumes from the newest checkpoint; raise
``--steps`` to train further, or pass ``--fresh`` to start over.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# The model and data live next to this script (its folder is on sys.path when run).
from data import TextWindows, decode, encode, load_bytes, split_text
from gpt import GPT, gpt_config, preset_names

import shardwise

HERE = Path(__file__).resolve().parent


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(HERE / "configs" / "stage2.yaml"), help="shardwise config (.yaml/.json)")
    parser.add_argument("--size", default="small", choices=preset_names(), help="GPT preset")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps in all (a resumed run counts on)")
    parser.add_argument("--run-dir", default=None, help="checkpoints, metrics and curves (default: runs/gpt-SIZE)")
    parser.add_argument("--fresh", action="store_true", help="delete the run directory's checkpoints and start over")
    parser.add_argument("--data", default=None, help="a text file (default: Python's stdlib source)")
    parser.add_argument("--data-bytes", type=int, default=2_000_000, help="read at most this many bytes")
    parser.add_argument("--eval-every", type=int, default=50, help="steps between evaluations on held-out text")
    parser.add_argument("--save-every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--seed", type=int, default=0, help="seeds the model init, data order and sampling")
    parser.add_argument("--sample-tokens", type=int, default=200, help="bytes to generate at the end (0: none)")
    parser.add_argument("--prompt", default="def ", help="text the sample starts from")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0: greedy)")
    parser.add_argument("--log-every", type=int, default=None, help="steps between metrics records and log lines (default: 10)")
    parser.add_argument("--max-seconds", type=float, default=None, help="stop (and save) after this many seconds")
    return parser.parse_args(argv)


class TimeLimit(shardwise.trainer.Callback):
    """Asks for a stop once ``seconds`` have passed; the trainer makes every rank stop at the same step."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.perf_counter()

    def on_step_end(self, trainer: shardwise.Trainer, metrics: dict[str, Any]) -> None:
        if time.perf_counter() - self.start > self.seconds:
            trainer.request_stop(f"--max-seconds {self.seconds:g} reached")


def log(message: str) -> None:
    """Print on rank 0 only, so a multi-rank run shows each line once."""
    if dist.get_rank() == 0:
        print(message, flush=True)


def prepare_run_dir(run: Path, model: GPT, fresh: bool) -> None:
    """Rank 0 empties the run directory if asked and writes ``model.json`` (what `shardwise generate` rebuilds)."""
    if dist.get_rank() == 0:
        if fresh:
            shutil.rmtree(run, ignore_errors=True)
        run.mkdir(parents=True, exist_ok=True)
        spec = {"source": str(HERE / "gpt.py"), "class": "GPT", "config_class": "GPTConfig",
                "config": asdict(model.config), "tokenizer": "bytes"}
        text = json.dumps(spec, indent=2) + "\n"
        target = run / "model.json"
        if not target.is_file() or target.read_text(encoding="utf-8") != text:  # a re-run touches nothing
            target.write_text(text, encoding="utf-8")
    dist.barrier()  # nobody looks for checkpoints before a --fresh delete is done


def describe(engine: shardwise.Engine, size: str, model: GPT, train: TextWindows, held_out: TextWindows) -> str:
    """One line on the model, the parallel setup and the data."""
    cfg = engine.config
    precision = "bf16" if cfg.bf16.enabled else "fp16" if cfg.fp16.enabled else "fp32"
    where = f"{next(engine.module.parameters()).device.type} ({dist.get_backend()})"  # `shardwise run` chose it
    return (
        f"GPT {size}: {model.num_parameters():,} params | {engine.world_size} rank(s) on {where}, ZeRO stage "
        f"{cfg.zero_optimization.stage}, {precision} | micro batch {engine.train_micro_batch_size_per_gpu()} x "
        f"accumulation {engine.gradient_accumulation_steps()} x block {model.config.block_size} | "
        f"{len(train):,} training windows, {len(held_out):,} held out"
    )


def sample(engine: shardwise.Engine, args: argparse.Namespace) -> str:
    """Generate from ``args.prompt`` (every rank runs it: stage 3 gathers weights collectively)."""
    engine.eval()
    torch.manual_seed(args.seed)  # same seed on every rank: same sample everywhere
    device = next(engine.module.parameters()).device
    out = engine.generate(encode(args.prompt)[None].to(device), max_new_tokens=args.sample_tokens,
                          temperature=args.temperature)
    return decode(out[0].cpu())


def train(args: argparse.Namespace) -> shardwise.trainer.FitSummary:
    shardwise.init_distributed()
    torch.manual_seed(args.seed)  # every rank builds the same model (the engine also syncs it)
    model = GPT(gpt_config(args.size))
    engine = shardwise.initialize(model, config=args.config)
    run = Path(args.run_dir or f"runs/gpt-{args.size}")
    prepare_run_dir(run, model, args.fresh)
    train_text, held_out_text = split_text(load_bytes(args.data, args.data_bytes))
    block = model.config.block_size
    train_data, held_out = TextWindows(train_text, block), TextWindows(held_out_text, block)
    log(describe(engine, args.size, model, train_data, held_out))
    trainer = shardwise.Trainer(
        engine, train_data, max_steps=args.steps, eval_data=held_out, eval_every=args.eval_every,
        checkpoint_dir=str(run / "checkpoints"), save_every=args.save_every, keep_last=2,
        metrics_file=str(run / "metrics.jsonl"), log_every=args.log_every, seed=args.seed,
        loss_fn=lambda output, batch: output[1],  # GPT returns (logits, loss)
        callbacks=[TimeLimit(args.max_seconds)] if args.max_seconds else [],
    )
    summary = trainer.fit()
    if args.sample_tokens > 0:
        start = time.perf_counter()
        text = sample(engine, args)
        log(f"--- sample ({args.sample_tokens} bytes, temperature {args.temperature:g}, KV cache, "
            f"{time.perf_counter() - start:.1f}s) ---\n{text}\n---")
    if summary.trained_steps == 0:
        log(f"(pass a larger --steps than {args.steps} to train further, or --fresh to start over)")
    kept = [name for name in ("checkpoints/", "metrics.jsonl", "metrics.png", "model.json") if (run / name).exists()]
    log(f"run directory {run}: {', '.join(kept)}; "  # what is there now, this run's or an earlier one's
        f"`shardwise generate {run / 'checkpoints'} --trust-model-source` samples again (the flag lets it run "
        f"the model's source, {HERE / 'gpt.py'}, which model.json names)")
    return summary


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
