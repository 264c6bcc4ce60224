"""Distillation: a bf16 ZeRO-3 teacher and an fp32 ZeRO-2 student, two engines from one config file.

    shardwise run --nproc-per-node 2 examples/distill.py

The teacher is built already partitioned (``shardwise.zero.Init``), so no rank
ever holds all of it, and its weights come from a consolidated checkpoint file
one module at a time (``shardwise.zero.load_state_dict``).  With no
``--teacher FILE``, the example first trains a bigger GPT for
``--teacher-steps`` steps and consolidates its checkpoint into
``OUT/teacher.safetensors``, so it runs on its own.  The student learns from
the teacher's softened next-byte distribution and from the text itself.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise
from shardwise.checkpoint import consolidate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import batches, load_bytes  # noqa: E402
from gpt import GPT, gpt_config  # noqa: E402

CONFIG = Path(__file__).resolve().parent / "configs" / "engines" / "distill.yaml"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(CONFIG), help="a file of named engines: `teacher` and `student`")
    p.add_argument("--teacher", help="the teacher's weights (.safetensors or .pt); default: train one first")
    p.add_argument("--teacher-size", default="small", help="GPT preset of the teacher")
    p.add_argument("--student-size", default="tiny", help="GPT preset of the student")
    p.add_argument("--teacher-steps", type=int, default=120, help="steps to train a teacher when none is given")
    p.add_argument("--steps", type=int, default=120, help="distillation steps")
    p.add_argument("--alpha", type=float, default=0.5, help="weight of the teacher's soft targets in the loss")
    p.add_argument("--temperature", type=float, default=2.0, help="softening of both distributions")
    p.add_argument("--out", default="runs/distill", help="where the teacher file and the checkpoints go")
    return p.parse_args()


def say(*parts: Any) -> None:
    if dist.get_rank() == 0:
        print(*parts, flush=True)


def train_teacher(args: argparse.Namespace, data: torch.Tensor, block: int) -> Path:
    """Train a teacher with a plain ZeRO-2 engine, save it, and consolidate it into one file."""
    out = Path(args.out)
    model = GPT(gpt_config(args.teacher_size, block_size=block))
    engine = shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3),
                                  {"zero_optimization": {"stage": 2}}, name="pretrain")
    for step in range(args.teacher_steps):
        x, y = batches(data, 16, block, rank=dist.get_rank(), world_size=dist.get_world_size(), seed=1, step=step)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    say(f"teacher ({model.num_parameters() / 1e6:.2f}M parameters) trained {args.teacher_steps} steps: "
        f"loss {loss.item():.3f}")
    path = engine.save_checkpoint(out / "teacher-checkpoint")
    engine.destroy()
    weights = out / "teacher.safetensors"
    if dist.get_rank() == 0:
        consolidate(path, weights)
    dist.barrier()
    return weights


def distillation_loss(student: torch.Tensor, teacher: torch.Tensor, hard: torch.Tensor, alpha: float,
                      temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(1 - alpha) * CE(text) + alpha * T² * KL(teacher_T || student_T)``; also returns the soft term."""
    soft = F.kl_div(F.log_softmax(student / temperature, dim=-1), F.log_softmax(teacher.float() / temperature, dim=-1),
                    log_target=True, reduction="batchmean") * temperature**2
    return (1 - alpha) * hard + alpha * soft, soft


def main() -> None:
    args = parse_args()
    shardwise.init_distributed()
    configs = shardwise.load_configs(args.config)
    block = 64
    data = load_bytes()
    weights = Path(args.teacher) if args.teacher else train_teacher(args, data, block)

    with shardwise.zero.Init(config=configs["teacher"]):
        teacher_model = GPT(gpt_config(args.teacher_size, block_size=block))
    shardwise.zero.load_state_dict(teacher_model, weights)
    teacher = shardwise.initialize(teacher_model, config=configs["teacher"], name="teacher").eval()
    student_model = GPT(gpt_config(args.student_size, block_size=block))
    student = shardwise.initialize(student_model, config=configs["student"], name="student")
    say(f"teacher {teacher_model.num_parameters() / 1e6:.2f}M (bf16, ZeRO-3, inference only), "
        f"student {student_model.num_parameters() / 1e6:.2f}M (fp32, ZeRO-2), {dist.get_world_size()} rank(s)")

    micro = student.train_micro_batch_size_per_gpu()
    for step in range(args.steps):
        x, y = batches(data, micro, block, rank=dist.get_rank(), world_size=dist.get_world_size(), seed=2, step=step)
        with torch.no_grad():
            teacher_logits, _ = teacher(x)
        logits, hard = student(x, y)
        loss, soft = distillation_loss(logits, teacher_logits, hard, args.alpha, args.temperature)
        student.backward(loss)
        student.step()
        if step % 20 == 0 or step == args.steps - 1:
            say(f"step {step + 1:4d} | loss {loss.item():.3f} | text {hard.item():.3f} | teacher KL {soft.item():.3f}")

    x, y = batches(data, micro, block, rank=dist.get_rank(), world_size=dist.get_world_size(), seed=3, step=0)
    with torch.no_grad():
        teacher_loss, student_loss = teacher(x, y)[1], student(x, y)[1]
    say(f"held-out loss: teacher {teacher_loss.item():.3f}, student {student_loss.item():.3f}")
    saved = shardwise.save_checkpoints(args.out, {"teacher": teacher, "student": student})
    say(f"saved both engines to {saved}")
    teacher.destroy()
    student.destroy()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
