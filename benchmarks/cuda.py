"""``python -m benchmarks.cuda``: shardwise on one CUDA GPU (NCCL), beside torch's peers and DeepSpeed.

The gloo benchmark (``benchmarks.run``) cannot say what happens on a GPU.
This one runs every ZeRO stage of shardwise on one GPU with a one-rank NCCL
group, beside the torch system a user would pick instead (DDP, DDP +
ZeroRedundancyOptimizer, FSDP2) and, when it is importable, DeepSpeed at the
same stage, from the same seed on the same batches.  Two ways, ``--isolation``:

* ``pair``: a stage's systems in one process, their timed steps interleaved
  (``benchmarks/cuda_steps.py``), so a clock or load change hits all of them;
  the ratio to shardwise is taken step by step.
* ``process``: each system alone in a fresh process: its step time without
  neighbours, and its peak GPU memory over the whole run.
* ``both`` (the default): the two side by side.

With one rank every collective is a copy, so the times measure what each
engine adds around the math on a GPU (hooks, flat buffers, gathers, the
optimizer over flat shards), not communication.  TFLOPS use
:data:`benchmarks.peaks.FLOPS_FORMULA`, against the card's dense bf16 peak
(``benchmarks/peaks.py``).  It also checks, on CUDA: every system's losses
against shardwise's (fp32 within ``--fp32-tol``, bf16 within ``--bf16-tol``),
and a checkpoint round trip (save, load into a fresh engine, the next step's
loss bit-identical).  It exits 1 when shardwise or a torch peer failed or
disagreed; DeepSpeed's problems are reported, not fatal.

``--device cpu`` runs the same code on one gloo rank (memory: n/a), so the
test suite keeps it working on machines without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

from .configs import System, peer_of
from .cuda_steps import Measured, measure_alone, measure_group, workload_of
from .deepspeed_peer import deepspeed_installed
from .peaks import FLOPS_FORMULA, bf16_peak, step_flops
from .workload import model_numel, seq_len

__all__ = ["main"]

ISOLATIONS = ("pair", "process", "both")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cuda", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: one gloo rank (tests)")
    parser.add_argument("--size", default="40m", help="GPT preset (examples/gpt.py)")
    parser.add_argument("--override", default="", help="preset fields, e.g. n_embd=768,n_head=12,n_layer=12")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=0, help="tokens per sequence; 0: the preset's block_size")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--isolation", choices=ISOLATIONS, default="both",
                        help="pair: interleaved in one process; process: each system alone; both (default)")
    parser.add_argument("--deepspeed", choices=["auto", "on", "off"], default="auto",
                        help="DeepSpeed as a peer: auto (when importable, the default), on (required), off")
    parser.add_argument("--fp32-tol", type=float, default=1e-4, help="relative loss difference allowed (fp32)")
    parser.add_argument("--bf16-tol", type=float, default=3e-2, help="relative loss difference allowed (bf16)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per alone process")
    parser.add_argument("--out", type=Path, default=Path("bench_out/cuda"))
    parser.add_argument("--alone", default=None, help=argparse.SUPPRESS)  # family:stage:dtype, in a child process
    parser.add_argument("--alone-out", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _overrides(args: argparse.Namespace) -> dict[str, int]:
    return {k: int(v) for k, v in (kv.split("=") for kv in args.override.split(",") if kv)}


def _with_deepspeed(choice: str) -> bool:
    found = deepspeed_installed()
    if choice == "on" and not found:
        raise SystemExit("--deepspeed on: DeepSpeed is not installed here; install it (tests/gpu/wheels.sh "
                         "--deepspeed carries a wheel to the device) or pass --deepspeed auto/off")
    return found and choice != "off"


def _groups(args: argparse.Namespace, deepspeed: bool) -> list[list[System]]:
    """Per dtype and stage: shardwise, its torch peer, and DeepSpeed at the stage when asked."""
    groups = []
    for dtype in args.dtypes:
        for stage in args.stages:
            mine = System("shardwise", stage, dtype)
            groups.append([mine, peer_of(mine)] + ([System("deepspeed", stage, dtype)] if deepspeed else []))
    return groups


def _alone_in_a_process(argv: list[str], system: System, timeout: float) -> Measured:
    """``system`` measured by a fresh ``python -m benchmarks.cuda --alone`` with the same workload arguments."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "alone.json"
        spec = f"{system.family}:{system.stage}:{system.dtype}"
        cmd = [sys.executable, "-m", "benchmarks.cuda", *argv, "--alone", spec, "--alone-out", str(out)]
        try:
            done = subprocess.run(cmd, cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return Measured(system.name, system.family, error=f"alone: no result within {timeout:g} s")
        if done.returncode != 0 or not out.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            return Measured(system.name, system.family, error=f"alone: exit {done.returncode}: {tail[0][:300]}")
        return Measured(**json.loads(out.read_text()))


def _row(args: argparse.Namespace, system: System, pair: Optional[Measured], alone: Optional[Measured],
         ours: Optional[Measured], flops: float, peak: Optional[float]) -> dict[str, Any]:
    """One system's line of the report (its paired and alone figures, and how it compares with shardwise)."""
    row: dict[str, Any] = {"stage": system.stage, "dtype": system.dtype, "system": system.name,
                           "family": system.family}
    errors = [m.error for m in (pair, alone) if m is not None and m.error]
    row["error"] = "; ".join(errors) or None
    row["ms"] = pair.median_ms(args.warmup) if pair else None
    row["alone_ms"] = alone.median_ms(args.warmup) if alone else None
    row["state_mib"] = next((m.state_mib for m in (pair, alone) if m is not None and m.state_mib is not None), None)
    row["step_peak_mib"] = pair.step_peak_mib if pair else None
    row["peak_mib"] = alone.peak_mib if alone else None
    row["checkpoint_ok"] = pair.checkpoint_ok if pair else None
    ms = row["alone_ms"] or row["ms"]
    row["tflops"] = flops / (ms / 1e3) / 1e12 if ms else None
    row["pct_bf16_peak"] = 100 * row["tflops"] / peak if row["tflops"] and peak else None
    _compare(args, row, system, pair, alone, ours)
    return row


def _compare(args: argparse.Namespace, row: dict[str, Any], system: System, pair: Optional[Measured],
             alone: Optional[Measured], ours: Optional[Measured]) -> None:
    """The paired step-time ratio shardwise ÷ this system, and the largest relative loss difference."""
    row["ratio"] = row["ratio_min"] = row["ratio_max"] = row["max_rel_loss_diff"] = None
    mine = pair if pair is not None and pair.losses else alone
    if ours is None or mine is None or not ours.losses or not mine.losses:
        row["loss_ok"] = None
        return
    diffs = [abs(a - b) / abs(b) for a, b in zip(ours.losses, mine.losses)]
    row["max_rel_loss_diff"] = max(diffs)
    row["loss_ok"] = row["max_rel_loss_diff"] <= (args.fp32_tol if system.dtype == "fp32" else args.bf16_tol)
    if pair is not None and system.family != "shardwise" and ours.times and pair.times:
        n = min(len(ours.times), len(pair.times))
        ratios = sorted(a / b for a, b in zip(ours.times[args.warmup:n], pair.times[args.warmup:n]))
        if ratios:
            row["ratio"], row["ratio_min"], row["ratio_max"] = ratios[len(ratios) // 2], ratios[0], ratios[-1]


def _cell(value: Any, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def _table(rows: list[dict[str, Any]], header: str) -> str:
    lines = [header, "",
             "| stage | dtype | system | step ms paired | shardwise ÷ it (min–max) | step ms alone | TFLOPS (% bf16 "
             "peak) | state MiB | step peak MiB | peak MiB alone | max rel. loss diff | checkpoint |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['ratio']:.2f}× ({r['ratio_min']:.2f}–{r['ratio_max']:.2f})" if r["ratio"] is not None else "—"
        tflops = _cell(r["tflops"], ".3g") + ("" if r["pct_bf16_peak"] is None else f" ({r['pct_bf16_peak']:.0f}%)")
        loss = "—" if r["family"] == "shardwise" else \
            f"{_cell(r['max_rel_loss_diff'], '.1e')} {'✓' if r['loss_ok'] else '✗'}"
        check = {True: "✓", False: "✗", None: "—"}[r["checkpoint_ok"]]
        lines.append(
            f"| {r['stage']} | {r['dtype']} | {r['system']} | {_cell(r['ms'], '.1f')} | {ratio} | "
            f"{_cell(r['alone_ms'], '.1f')} | {tflops} | {_cell(r['state_mib'], '.0f')} | "
            f"{_cell(r['step_peak_mib'], '.0f')} | {_cell(r['peak_mib'], '.0f')} | {loss} | {check} |"
            + (f" error: {r['error']}" if r["error"] else ""))
    return "\n".join(lines) + "\n"


def _header(args: argparse.Namespace, overrides: dict[str, int], peak: Optional[float]) -> str:
    if args.device == "cuda":
        name = torch.cuda.get_device_name()
        where = f"{name}, 1 rank (NCCL)"
        peak_text = f"{peak:g} TFLOPS dense bf16 ({name})" if peak else f"n/a ({name} is not in benchmarks/peaks.py)"
    else:
        where, peak_text = "CPU, 1 rank (gloo)", "n/a on the CPU"
    seq = seq_len(workload_of(args))
    return (f"GPT {args.size} {overrides or ''} ({model_numel(args.size, **overrides) / 1e6:.1f}M parameters) on "
            f"{where}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M %Z')}; micro-batch "
            f"{args.micro_batch} × {seq} tokens, {args.warmup} warm-up + {args.steps} timed steps; isolation "
            f"{args.isolation}.\nTFLOPS: {FLOPS_FORMULA}, from the alone median where measured; % of {peak_text}. "
            "State: parameters, master weights, gradients and optimizer state as each system holds them; step peak: "
            "the most one paired step allocated above what was allocated before it; peak alone: "
            "torch.cuda.max_memory_allocated over a whole run in its own process.")


def _healthy(rows: list[dict[str, Any]]) -> bool:
    """Shardwise and the torch peers ran, agreed on the losses and round-tripped a checkpoint (DeepSpeed may not)."""
    ours = [r for r in rows if r["family"] != "deepspeed"]
    return all(r["error"] is None and r["loss_ok"] is not False and r["checkpoint_ok"] is not False for r in ours)


def _run_alone(args: argparse.Namespace, overrides: dict[str, int]) -> int:
    family, stage, dtype = args.alone.split(":")
    measured = measure_alone(args, System(family, int(stage), dtype), overrides)
    args.alone_out.write_text(json.dumps(measured.as_dict()))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the groups; write ``cuda.md`` / ``cuda.json`` under ``--out``; exit 1 on a failed check."""
    import shardwise

    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks.cuda needs a CUDA GPU; the gloo comparison is `python -m benchmarks.run`")
    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity means fp32 math on every side
    shardwise.init_distributed(backend="nccl" if args.device == "cuda" else "gloo")
    overrides = _overrides(args)
    args.seq_len = args.seq_len or overrides.get("block_size", 0)  # 0: the model's block_size, overridden or not
    if args.alone:
        return _run_alone(args, overrides)
    peak = bf16_peak(torch.cuda.get_device_name()) if args.device == "cuda" else None
    flops = step_flops(args.size, overrides, args.micro_batch, args.seq_len)
    rows = []
    for group in _groups(args, _with_deepspeed(args.deepspeed)):
        none: list[Optional[Measured]] = [None] * len(group)
        paired: list[Optional[Measured]] = list(measure_group(args, group, overrides)) \
            if args.isolation != "process" else none
        alone: list[Optional[Measured]] = [_alone_in_a_process(argv, s, args.timeout) for s in group] \
            if args.isolation != "pair" else none
        ours = paired[0] or alone[0]
        rows += [_row(args, s, p, a, ours, flops, peak) for s, p, a in zip(group, paired, alone)]
    header = _header(args, overrides, peak)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cuda.md").write_text(_table(rows, header))
    (args.out / "cuda.json").write_text(json.dumps({"header": header, "bf16_peak_tflops": peak,
                                                    "step_flops": flops, "rows": rows}, indent=2))
    print(_table(rows, header))
    return 0 if _healthy(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
