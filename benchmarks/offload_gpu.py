"""ZeRO-Offload on one GPU (issue 38): the largest GPT that trains, the step time, TFLOPS and the bytes moved.

``python -m benchmarks.offload --device cuda [--part all|bandwidth|capacity|speed] [--out DIR]`` on a machine with
one GPU; ``--device cpu`` runs the same program at a tiny size (a few seconds, in the CPU suite), taking the
host path on the CPU (:func:`~shardwise.zero.store.plan.host_path_on_cpu`) so every figure has a value.

* **bandwidth**: host to device and device to host, pinned, 1 GiB (the bound on the copies below).
* **capacity**: for each setting (``--settings``: ``none``; ``cpu``, the optimizer in host memory; ``cpu+param``,
  and stage 3's parameters too; ``nvme``, the optimizer state on NVMe under ``--nvme`` with ``--ratio`` of it
  there and the rest in host memory, parameters in host memory; ``nvme-opt``, the same with the parameters on the
  card; ``nvme+param``, the parameters' shards in a file
  under ``--nvme`` too, up to 1e9 elements of them in host memory) and each layer count of ``--layers`` in
  turn, a GPT of width ``--width`` (``--heads`` heads, ``--vocab`` tokens, tied head) built with
  ``shardwise.zero.Init`` straight on the card, activation checkpointing on every block, stage 3, bf16,
  AdamW, trains 3 steps of one sequence of ``--seq`` tokens: trained or not (out of memory, killed, over
  ``--trial-timeout``), peak GPU memory, peak host memory, the steps' times.  Each try is a process of its
  own (a failed one leaves nothing behind); a setting stops at its first failure.
* **speed**: a GPT of ``--speed-layers`` x ``--speed-width`` (1.2B by default) with and without optimizer
  offload to host memory at ``--tokens`` tokens a step (micro-batches of ``--micro`` sequences, accumulated):
  median step time of ``--steps`` after a warm-up step, TFLOPS by :data:`~.peaks.FLOPS_FORMULA` against the
  card's bf16 peak (:mod:`.peaks`), and the bytes copied each way per step against theory (gradients down,
  4 bytes an element of the offloaded state; values up, 2 bytes an element in bf16; with parameters in host
  memory each gather copies its shard up) and the time they take at the measured bandwidth.  DeepSpeed's
  ZeRO-Offload (``DeepSpeedCPUAdam``) runs the same configurations when ``deepspeed`` is importable.

Results are printed as markdown rows and written to ``DIR/offload_gpu.json``; docs/offload.md's GPU table comes
from here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from .deepspeed_peer import deepspeed_installed, ready_for_deepspeed
from .peaks import FLOPS_FORMULA, bf16_peak
from .worker import rss_bytes
from .workload import gpt_module

__all__ = ["SETTINGS", "bandwidth", "main", "trial", "zero_section"]

#: capacity settings: what each offloads
SETTINGS = ("none", "cpu", "cpu+param", "nvme", "nvme-opt", "nvme+param")
#: the tiny run of ``--device cpu`` (the CPU suite's): width, heads, layers, sequence, vocabulary
_TINY = {"width": 64, "heads": 2, "layers": "1,2", "seq": 32, "vocab": 256, "speed_layers": 2, "speed_width": 64,
         "tokens": 128, "micro": 2, "steps": 2, "sub_group": 20_000}


def zero_section(setting: str, nvme: str, ratio: float, sub_group: int) -> dict[str, Any]:
    """``zero_optimization`` for ``setting`` (stage 3; pinned host buffers)."""
    zero: dict[str, Any] = {"stage": 3, "sub_group_size": sub_group}
    if setting in ("cpu", "cpu+param"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if setting.startswith("nvme"):
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "pin_memory": True, "ratio": ratio,
                                     "buffer_count": 4}
    if setting in ("cpu+param", "nvme"):  # (`nvme-opt`: the parameters stay on the card)
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if setting == "nvme+param":  # the shards in a file too, 1e9 elements of them in host memory (DeepSpeed's default)
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme, "pin_memory": True, "buffer_count": 4,
                                 "max_in_cpu": 1_000_000_000}
    return zero


class _Checkpointed(nn.Module):
    """A block whose activations are recomputed in backward (``torch.utils.checkpoint``, non-reentrant)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor, **_: Any) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        out: torch.Tensor = checkpoint(self.block, x, use_reentrant=False)
        return out


def _build(spec: dict[str, Any], config: dict[str, Any], device: torch.device) -> nn.Module:
    gpt = gpt_module()
    shape = gpt.GPTConfig(vocab_size=spec["vocab"], block_size=spec["seq"], n_layer=spec["layers"],
                          n_head=spec["heads"], n_embd=spec["width"])
    torch.manual_seed(0)
    with torch.device(device), _partitioned(spec, config):
        model = gpt.GPT(shape)
    model.blocks = nn.ModuleList(_Checkpointed(block) for block in model.blocks)
    return model  # type: ignore[no-any-return]


def _engine(spec: dict[str, Any], device: torch.device) -> tuple[Any, int]:
    import shardwise
    from shardwise.zero.store.plan import host_path_on_cpu

    config = {"zero_optimization": zero_section(spec["setting"], spec["nvme"], spec["ratio"], spec["sub_group"]),
              "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": spec["micro"],
              "gradient_accumulation_steps": spec["accumulation"], "gradient_clipping": 1.0}
    model = _build(spec, config, device)
    # (DeepSpeed's zero.Init leaves each parameter empty, its size in `ds_numel`)
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    if spec["peer"]:
        return _deepspeed(model, config), numel
    with host_path_on_cpu():  # (a CPU job takes the host path as a GPU job does; nothing changes on a GPU job)
        engine = shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)
    return engine, numel


def _partitioned(spec: dict[str, Any], config: dict[str, Any]) -> Any:
    """The ``zero.Init`` of the engine that will train the model: DeepSpeed's own for the peer (its engine takes only
    parameters its ``zero.Init`` partitioned), else shardwise's."""
    if spec["peer"]:
        ready_for_deepspeed()
        import deepspeed

        return deepspeed.zero.Init(config_dict_or_path=_ds_config(config))
    import shardwise

    return shardwise.zero.Init(config=config)


def _ds_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` for DeepSpeed: with optimizer offload, an ``optimizer`` section, so that it builds its compiled
    ``DeepSpeedCPUAdam`` (what its ZeRO-Offload runs); without, none (the torch AdamW passed, as shardwise's)."""
    ds = json.loads(json.dumps(config))
    if "offload_optimizer" in ds["zero_optimization"]:
        ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4}}
    ds["steps_per_print"] = 1 << 30
    return ds


def _deepspeed(model: nn.Module, config: dict[str, Any]) -> Any:
    """DeepSpeed's engine for the same config (see :func:`_ds_config`)."""
    ready_for_deepspeed()
    import deepspeed

    ds = _ds_config(config)
    optimizer = None if "optimizer" in ds else torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=optimizer,
                                      config=ds)
    return engine


def _moved(engine: Any) -> tuple[int, int]:
    """Bytes copied (down, up) so far between the card and host memory by the store and the shards."""
    strategy = getattr(engine, "strategy", None)
    if strategy is None:  # DeepSpeed's engine: not counted (its speed rows say n/a)
        return 0, 0
    copies = strategy.store.home.copies
    shards = getattr(strategy, "shards", None)
    down = (copies.moved.down if copies is not None else 0) + getattr(shards, "down", 0)
    up = (copies.moved.up if copies is not None else 0) + getattr(shards, "up", 0)
    return down, up


def trial(spec: dict[str, Any]) -> dict[str, Any]:
    """One process: build, train ``spec["steps"] + 1`` steps (the first a warm-up), measure (see the module docstring)."""
    import torch.distributed as dist

    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(0)
    rendezvous = tempfile.mktemp(prefix="offload-gpu-rdv-")  # a file: no port to clash with another job's
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{rendezvous}",
                            rank=0, world_size=1)
    start = time.perf_counter()
    engine, numel = _engine(spec, device)
    built = time.perf_counter() - start
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    times, moved = [], (0, 0)
    for step in range(spec["steps"] + 1):
        if step == 1:
            moved = _moved(engine)
        sync()
        start = time.perf_counter()
        for _ in range(spec["accumulation"]):
            x = torch.randint(0, spec["vocab"], (spec["micro"], spec["seq"]), generator=gen).to(device)
            _, loss = engine(x, x)
            engine.backward(loss)
            engine.step()
        sync()
        times.append(time.perf_counter() - start)
    down, up = (now - then for now, then in zip(_moved(engine), moved))
    peak_gpu = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    return {"numel": numel, "build_s": built, "step_s": times[1:], "loss": float(loss), "peak_gpu": peak_gpu,
            "peak_host": rss_bytes("VmHWM"), "down_per_step": down / spec["steps"], "up_per_step": up / spec["steps"],
            "apart": _apart(engine)}


def _apart(engine: Any) -> int:
    strategy = getattr(engine, "strategy", None)
    if strategy is None:
        return 0
    home = strategy.store.home
    return sum(p.numel for p in home.pieces if p.key is not None and home.apart(p))


def _run_trial(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """``trial(spec)`` in a process of its own: its result, or why it failed (out of memory, killed, timeout)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
        path = out.name
    command = [sys.executable, "-m", "benchmarks.offload_gpu", "--trial", json.dumps(spec), "--trial-out", path]
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"result": f"over {timeout:.0f} s"}
    if done.returncode == 0:
        result: dict[str, Any] = json.loads(Path(path).read_text())
        os.unlink(path)
        return {"result": "trains", **result}
    text = done.stdout + done.stderr
    why = ("out of GPU memory" if "OutOfMemoryError" in text or "CUDA out of memory" in text
           else "killed (host memory?)" if done.returncode < 0 else f"exit {done.returncode}")
    tail = [line for line in text.splitlines() if line.strip()][-3:]
    return {"result": why, "tail": tail}


def bandwidth(device: torch.device, gib: float = 1.0) -> tuple[float, float]:
    """(host to device, device to host) GB/s of one pinned ``gib`` GiB copy (plain memory copies on a CPU)."""
    numel = int(gib * (1 << 30)) // 4
    host = torch.empty(numel, pin_memory=device.type == "cuda")
    target = torch.empty(numel, device=device)
    rates = []
    for src, dst in ((host, target), (target, host)):
        dst.copy_(src, non_blocking=True)  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        rates.append(numel * 4 / (time.perf_counter() - start) / 1e9)
    return rates[0], rates[1]


def _spec(args: argparse.Namespace, setting: str, layers: int, width: int, micro: int, accumulation: int,
          peer: bool = False) -> dict[str, Any]:
    return {"device": args.device, "setting": setting, "layers": layers, "width": width, "heads": args.heads,
            "vocab": args.vocab, "seq": args.seq, "micro": micro, "accumulation": accumulation,
            "steps": args.steps, "nvme": args.nvme, "ratio": args.ratio, "sub_group": args.sub_group, "peer": peer}


def _size(numel: float) -> str:
    return f"{numel / 1e9:.2f}B" if numel >= 1e8 else f"{numel / 1e6:.2f}M"


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 or nbytes != nbytes else f"{nbytes / 1e6:.2f} MB"


def _row(spec: dict[str, Any], r: dict[str, Any]) -> str:
    size = f"{_size(r['numel'])} ({spec['layers']} x {spec['width']})" if "numel" in r else \
        f"{spec['layers']} x {spec['width']}"
    if r["result"] != "trains":
        return f"| {spec['setting']} | {'DeepSpeed' if spec['peer'] else 'shardwise'} | {size} | {r['result']} | | | |"
    steps = ", ".join(f"{t:.2f}" for t in r["step_s"])
    return (f"| {spec['setting']} | {'DeepSpeed' if spec['peer'] else 'shardwise'} | {size} | trains | "
            f"{r['peak_gpu'] / 2**30:.1f} | {r['peak_host'] / 2**30:.1f} | {steps} |")


def capacity(args: argparse.Namespace) -> list[dict[str, Any]]:
    print("| setting | engine | parameters | 3 steps at seq {args.seq} | peak GPU GiB | peak host GiB | step s |"
          .replace("{args.seq}", str(args.seq)))
    print("|---|---|---|---|---|---|---|", flush=True)
    found = []
    for setting in args.settings.split(","):
        for layers in (int(n) for n in args.layers.split(",")):
            spec = _spec(args, setting, layers, args.width, 1, 1)
            r = _run_trial(spec, args.trial_timeout)
            print(_row(spec, r), flush=True)
            found.append({"spec": spec, **r})
            if r["result"] != "trains":
                break
    return found


def _theory(r: dict[str, Any], setting: str) -> tuple[float, float]:
    """Bytes (down, up) a step: each offloaded element's fp32 gradient down and bf16 value up once (parameters in
    host memory go up at each gather instead, counted as measured)."""
    return r["apart"] * 4.0, r["apart"] * 2.0 if "param" not in setting else float("nan")


def speed(args: argparse.Namespace, rates: tuple[float, float]) -> list[dict[str, Any]]:
    micro = args.micro
    accumulation = max(1, args.tokens // (micro * args.seq))
    peak = bf16_peak(torch.cuda.get_device_name()) if args.device == "cuda" else None
    print(f"\nspeed: {accumulation} x {micro} sequences of {args.seq} tokens a step; {FLOPS_FORMULA}")
    print("| setting | engine | parameters | step s, median (range) | TFLOPS | % of bf16 peak | down / up a step "
          "(theory) | at the measured bandwidth, s | last loss |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    found = []
    peers = [False, True] if deepspeed_installed() else [False]
    for peer in peers:
        for setting in ("none", "cpu"):
            spec = _spec(args, setting, args.speed_layers, args.speed_width, micro, accumulation, peer)
            r = _run_trial(spec, args.trial_timeout)
            found.append({"spec": spec, **r})
            if r["result"] != "trains":
                print(_row(spec, r), flush=True)
                continue
            step = statistics.median(r["step_s"])
            flops = _flops(r["numel"], spec) / step / 1e12
            share = f"{100 * flops / peak:.0f}%" if peak else "-"
            down, up = r["down_per_step"], r["up_per_step"]
            want = _theory(r, setting)
            at = down / 1e9 / rates[1] + up / 1e9 / rates[0]
            moved = f"n/a ({_gb(want[0])} / {_gb(want[1])}) | n/a" if peer else \
                f"{_gb(down)} / {_gb(up)} ({_gb(want[0])} / {_gb(want[1])}) | {at:.3f}"
            print(f"| {setting} | {'DeepSpeed' if peer else 'shardwise'} | {_size(r['numel'])} | {step:.2f} "
                  f"({min(r['step_s']):.2f}-{max(r['step_s']):.2f}) | {flops:.1f} | {share} | {moved} | "
                  f"{r['loss']:.3f} |", flush=True)
    return found


def _flops(numel: int, spec: dict[str, Any]) -> float:
    tokens = spec["micro"] * spec["accumulation"] * spec["seq"]
    return float((6 * numel + 12 * spec["layers"] * spec["seq"] * spec["width"]) * tokens)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--part", default="all", choices=("all", "bandwidth", "capacity", "speed"))
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--layers", default="16,24,32,40,48,64", help="capacity: layer counts, in order")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--speed-layers", type=int, default=24)
    parser.add_argument("--speed-width", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=65_536, help="speed: tokens a step")
    parser.add_argument("--micro", type=int, default=8, help="speed: sequences a micro-batch")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ratio", type=float, default=0.5, help="nvme: the share of the optimizer state on disk")
    parser.add_argument("--sub-group", type=int, default=100_000_000)
    parser.add_argument("--nvme", default=None, help="nvme: the folder on the disk (default: a temp folder)")
    parser.add_argument("--trial-timeout", type=float, default=600)
    parser.add_argument("--out", default=None)
    parser.add_argument("--trial", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--trial-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trial is not None:
        Path(args.trial_out).write_text(json.dumps(trial(json.loads(args.trial))))
        return
    if args.device == "cpu":  # the tiny version, unless sizes were given
        for key, value in _TINY.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    args.nvme = args.nvme or tempfile.mkdtemp(prefix="offload-gpu-")
    device = torch.device(args.device)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"device: {name}; torch {torch.__version__}")
    results: dict[str, Any] = {"device": name}
    rates = bandwidth(device, 1.0 if args.device == "cuda" else 0.0625)
    results["bandwidth_gbs"] = {"host_to_device": rates[0], "device_to_host": rates[1]}
    print(f"pinned copies: host to device {rates[0]:.1f} GB/s, device to host {rates[1]:.1f} GB/s")
    if args.part in ("all", "capacity"):
        results["capacity"] = capacity(args)
    if args.part in ("all", "speed"):
        results["speed"] = speed(args, rates)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "offload_gpu.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
