"""``python -m benchmarks.same_math``: does a change keep the math bit for bit?

A structural change (files moved, classes merged, a store rewritten) must not move a single bit
of any result.  This runs one short training per configuration on 2 gloo ranks and records, per
configuration, the full fp32 weights after every optimizer step and every reported gradient norm;
``--compare A B`` says which configurations differ between two recordings (``torch.equal``).

The configurations (56): ZeRO stages 0-3 × fp32/bf16/fp16 × clipping on/off × a parameter no
rank ever has a gradient for (on/off), plus NVMe optimizer offload at stages 1-3 and both
offloads at stage 3, each in fp32 and bf16.  Every run: AdamW, 4 optimizer steps with
accumulation 2, micro-batch 4.

Only the public API is used, so the same file records a tree checked out elsewhere::

    PYTHONPATH=/path/to/old/src python -m benchmarks.same_math --out old.pt
    PYTHONPATH=src python -m benchmarks.same_math --out new.pt
    python -m benchmarks.same_math --compare old.pt new.pt
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["configurations", "main"]

_STEPS = 4
_ACCUMULATION = 2


class _Net(nn.Module):
    """Embedding + MLP with uneven sizes; ``unused`` is a parameter no forward ever reads."""

    def __init__(self, unused: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(64, 16)
        self.fc1 = nn.Linear(16, 24)
        self.fc2 = nn.Linear(24, 24)
        self.head = nn.Linear(24, 8)
        self.unused = nn.Linear(8, 8) if unused else None

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx).mean(dim=1)
        h = torch.tanh(self.fc1(h))
        h = torch.tanh(self.fc2(h))
        return F.mse_loss(self.head(h).float(), target)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 64, (4, 6), generator=gen), torch.randn(4, 8, generator=gen)


def configurations() -> list[dict[str, Any]]:
    """Every configuration recorded, as (name, stage, dtype, clip, unused, offload)."""
    plain: list[dict[str, Any]] = [
        {"stage": s, "dtype": d, "clip": c, "unused": u, "offload": ""}
        for s, d, c, u in itertools.product(range(4), ("fp32", "bf16", "fp16"), (False, True), (False, True))
    ]
    offloaded: list[dict[str, Any]] = [
        {"stage": s, "dtype": d, "clip": True, "unused": False, "offload": o}
        for (s, o), d in itertools.product(
            ((1, "optimizer"), (2, "optimizer"), (3, "optimizer"), (3, "both")), ("fp32", "bf16"))
    ]
    for case in plain + offloaded:
        case["name"] = (f"s{case['stage']}-{case['dtype']}-clip{int(case['clip'])}-unused{int(case['unused'])}"
                        + (f"-offload_{case['offload']}" if case["offload"] else ""))
    return plain + offloaded


def _config(case: dict[str, Any], nvme: str) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": case["stage"], "reduce_bucket_size": 500}
    if case["stage"] == 3:
        zero["stage3_param_persistence_threshold"] = 0
    if case["offload"]:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
        zero["sub_group_size"] = 300
    if case["offload"] == "both":
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": _ACCUMULATION,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.05}},
        "zero_optimization": zero,
    }
    if case["clip"]:
        config["gradient_clipping"] = 0.05
    if case["dtype"] == "bf16":
        config["bf16"] = {"enabled": True}
    elif case["dtype"] == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return config


def _run_case(case: dict[str, Any], nvme: str) -> Optional[dict[str, Any]]:
    import shardwise  # in the ranks, from whichever tree PYTHONPATH names

    rank = torch.distributed.get_rank()
    engine = shardwise.initialize(_Net(case["unused"]), config=_config(case, nvme))
    weights, norms = [], []
    for step in range(_STEPS * _ACCUMULATION):
        loss = engine(*_batch(step, rank))
        engine.backward(loss)
        if engine.step():
            norm = engine.get_global_grad_norm()
            norms.append(None if norm is None else float(norm))
            full = engine.full_state_dict()
            weights.append({k: v.detach().float().clone() for k, v in full.items()})
    engine.destroy()
    return {"weights": weights, "norms": norms} if rank == 0 else None


def _record_all(cases: list[dict[str, Any]], nvme: str) -> Optional[dict[str, Any]]:
    results = {case["name"]: _run_case(case, nvme) for case in cases}
    return results if torch.distributed.get_rank() == 0 else None


def record(only: Optional[str] = None) -> dict[str, Any]:
    """Every configuration's weights and norms (names containing ``only``, when given)."""
    from shardwise.testing import run_distributed

    cases = [c for c in configurations() if only is None or only in c["name"]]
    with tempfile.TemporaryDirectory(prefix="same-math-") as nvme:  # one path: the ranks' configs must agree
        return run_distributed(_record_all, world_size=2, args=(cases, nvme), timeout=1800.0,
                               env={"SHARDWISE_LOG_LEVEL": "WARNING"})[0]


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The configurations whose weights or norms differ (or that only one recording has)."""
    return sorted(name for name in a.keys() | b.keys() if name not in a or name not in b or not _equal(a[name], b[name]))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.same_math", description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="record every configuration into this file")
    parser.add_argument("--only", help="record only configurations whose name contains this")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two recordings")
    args = parser.parse_args(argv)
    if args.compare:
        a, b = (torch.load(path, weights_only=True) for path in args.compare)
        differ = compare(a, b)
        print(f"{len(a.keys() & b.keys()) - len([d for d in differ if d in a and d in b])} of "
              f"{len(a.keys() | b.keys())} configurations torch.equal; differ: {differ or 'none'}")
        return 1 if differ else 0
    if not args.out:
        parser.error("give --out FILE to record, or --compare A B")
    torch.save(record(args.only), args.out)
    print(f"recorded {len(configurations()) if args.only is None else 'some'} configurations into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
