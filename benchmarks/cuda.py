"""``python -m benchmarks.cuda``: shardwise on one CUDA GPU (NCCL), paired with torch's peers.

The gloo benchmark (``benchmarks.run``) cannot say what happens on a GPU.
This one runs every ZeRO stage of shardwise on one GPU with a one-rank NCCL
group, each beside the torch system a user would pick instead (DDP, DDP +
ZeroRedundancyOptimizer, FSDP2), from the same seed on the same batches.
Timed steps alternate A B, B A, ... in one process, each bracketed by
``torch.cuda.synchronize()``, so a clock or load change hits both.

With one rank every collective is a copy, so the figures measure what the
engine adds around the math on a GPU (hooks, flat buffers, gathers, the
optimizer over flat shards), not communication.  It also checks, on CUDA:
losses against the peer's (fp32 within ``--fp32-tol``, bf16 within
``--bf16-tol``), and a checkpoint round trip (save, load into a fresh engine,
the next step's loss bit-identical to the original engine's).

``--device cpu`` runs the same code on one gloo rank, so the test suite keeps
it working on machines without a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .configs import System, Workload, peer_of
from .systems import Harness, ShardwiseHarness, build_harness
from .workload import batch, gpt_module, synthetic_stream

__all__ = ["main"]


@dataclass
class _Timed:
    """What one system measured in a pair."""

    name: str
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    state_mib: float = 0.0


def _model(args: argparse.Namespace, overrides: dict[str, int]) -> torch.nn.Module:
    gpt = gpt_module()
    torch.manual_seed(args.seed)
    return gpt.GPT(gpt.gpt_config(args.size, **overrides)).to(args.device)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _step(harness: Any, xy: tuple[torch.Tensor, ...], measure: bool, timed: _Timed, device: str) -> None:
    _sync(device)
    start = time.perf_counter()
    loss = harness.step(*xy, measure)
    _sync(device)
    timed.times.append(time.perf_counter() - start)
    timed.losses.append(float(loss))
    if measure:
        timed.state_mib = sum(harness.state.values()) / 2**20


def _pair(args: argparse.Namespace, system: System, overrides: dict[str, int]) -> dict[str, Any]:
    workload = Workload(size=args.size, world_size=1, micro_batch=args.micro_batch, seq_len=args.seq_len,
                        warmup=args.warmup, steps=args.steps, seed=args.seed, lr=args.lr)
    stream = synthetic_stream(args.seed)
    systems = [system, peer_of(system)]
    harnesses = [build_harness(s, _model(args, overrides), workload) for s in systems]
    runs = [_Timed(s.name) for s in systems]
    for step in range(workload.total_steps):
        xy = tuple(t.to(args.device) for t in batch(stream, workload, 0, step))
        order = [0, 1] if step % 2 == 0 else [1, 0]
        for i in order:
            _step(harnesses[i], xy, step == workload.total_steps - 1, runs[i], args.device)
    ours, peer = runs
    ratios = [a / b for a, b in zip(ours.times[args.warmup:], peer.times[args.warmup:])]
    tol = args.fp32_tol if system.dtype == "fp32" else args.bf16_tol
    diff = max(abs(a - b) / abs(b) for a, b in zip(ours.losses, peer.losses))
    result = {
        "system": ours.name, "peer": peer.name,
        "ms": statistics.median(ours.times[args.warmup:]) * 1e3,
        "peer_ms": statistics.median(peer.times[args.warmup:]) * 1e3,
        "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "state_mib": ours.state_mib, "peer_state_mib": peer.state_mib,
        "loss_first": ours.losses[0], "loss_last": ours.losses[-1],
        "max_rel_loss_diff": diff, "loss_ok": diff <= tol, "tolerance": tol,
        "checkpoint_ok": _checkpoint_round_trip(harnesses[0], stream, workload, overrides, args),
    }
    del harnesses
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def _checkpoint_round_trip(
    harness: Harness, stream: torch.Tensor, workload: Workload, overrides: dict[str, int],
    args: argparse.Namespace,
) -> bool:
    """Save, load into a fresh engine at the same stage, and compare the next step's loss exactly."""
    assert isinstance(harness, ShardwiseHarness), "the first harness of a pair is shardwise's"
    engine = harness.engine
    system = System("shardwise", engine.config.zero_optimization.stage, "bf16" if engine.bfloat16_enabled() else "fp32")
    with tempfile.TemporaryDirectory() as tmp:
        engine.save_checkpoint(tmp, tag="t")
        fresh = ShardwiseHarness(_model(args, overrides), system, workload)
        path, _ = fresh.engine.load_checkpoint(tmp, tag="t")
        x, y = (t.to(args.device) for t in batch(stream, workload, 0, workload.total_steps))
        a = float(harness.step(x, y, False))
        b = float(fresh.step(x, y, False))
        del fresh
    return path is not None and a == b


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cuda", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: one gloo rank (tests)")
    parser.add_argument("--size", default="40m", help="GPT preset (examples/gpt.py)")
    parser.add_argument("--override", default="", help="preset fields, e.g. n_embd=768,n_head=12,n_layer=12")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--fp32-tol", type=float, default=1e-4, help="relative loss difference allowed (fp32)")
    parser.add_argument("--bf16-tol", type=float, default=3e-2, help="relative loss difference allowed (bf16)")
    parser.add_argument("--out", type=Path, default=Path("bench_out/cuda"))
    return parser.parse_args(argv)


def _table(rows: list[dict[str, Any]], header: str) -> str:
    lines = [header, "",
             "| system | peer | step ms (shardwise / peer) | time × (paired, min–max) | state MiB (shardwise / peer) "
             "| loss first → last | max rel. loss diff | checkpoint |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['system']} | {r['peer']} | {r['ms']:.1f} / {r['peer_ms']:.1f} | {r['ratio']:.2f}× "
            f"({r['ratio_min']:.2f}–{r['ratio_max']:.2f}) | {r['state_mib']:.0f} / {r['peer_state_mib']:.0f} "
            f"| {r['loss_first']:.3f} → {r['loss_last']:.3f} | {r['max_rel_loss_diff']:.1e} "
            f"{'✓' if r['loss_ok'] else '✗'} | {'✓' if r['checkpoint_ok'] else '✗'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the pairs; write ``cuda.md`` / ``cuda.json`` under ``--out``; exit 1 on a failed check."""
    import shardwise

    args = _parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks.cuda needs a CUDA GPU; the gloo comparison is `python -m benchmarks.run`")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity means fp32 math on both sides
    shardwise.init_distributed(backend="nccl" if args.device == "cuda" else "gloo")
    overrides = {k: int(v) for k, v in (kv.split("=") for kv in args.override.split(",") if kv)}
    rows = [_pair(args, System("shardwise", stage, dtype), overrides)
            for dtype in args.dtypes for stage in args.stages]
    where = f"{torch.cuda.get_device_name()}, 1 rank (NCCL)" if args.device == "cuda" else "CPU, 1 rank (gloo)"
    header = (f"GPT {args.size} {overrides or ''} on {where}, torch "
              f"{torch.__version__}, micro-batch {args.micro_batch}, {args.warmup} warm-up + {args.steps} timed steps")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cuda.md").write_text(_table(rows, header))
    (args.out / "cuda.json").write_text(json.dumps({"header": header, "rows": rows}, indent=2))
    print(_table(rows, header))
    return 0 if all(r["loss_ok"] and r["checkpoint_ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
