"""Live tensor bytes of a training step on the CPU: what ``torch.cuda.memory_allocated`` would say on a GPU.

Every storage a step touches is followed by a weak reference (a storage's Python object lives as long as its
memory, even when only autograd holds it): the ones alive at the start (every tensor the garbage collector
knows), and every input and output of every ATen operation (a :class:`~torch.utils._python_dispatch
.TorchDispatchMode`).  After each operation the bytes of the distinct live storages are summed, at their size
now: a storage resized to 0 (a freed stage 3 unit, an FSDP2 unsharded parameter) counts 0, as it would in the
CUDA allocator.  ``before`` is the sum when the step starts (model, masters, optimizer state); ``peak`` the most
one step held above it (``benchmarks.cuda``'s "step peak"), with the storages alive at that point grouped by
the operation that made them.  Not seen, on a GPU as here: buffers inside a collective's backend.  Not seen here
only: temporaries inside a tensor subclass's own dispatch (FSDP2's optimizer step on DTensors).

    python -m benchmarks.cpu_memory --size 40m --dtype fp32 bf16 --world 1 2
    python -m benchmarks.cpu_memory --stage 0 1 2 --dtype bf16 --world 1   # each stage against its torch peer

``--systems`` takes families (``shardwise``, ``ddp``, ``zero1``, ``fsdp2``, ``deepspeed``) or ``peer``: the torch
system a stage is compared against (:func:`benchmarks.configs.peer_of`: DDP at stage 0, ZeroRedundancyOptimizer at 1,
FSDP2 without resharding at 2, FSDP2 at 3).
"""

from __future__ import annotations

import argparse
import gc
import weakref
from collections import Counter
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .configs import System, Workload, peer_of
from .cuda import _overrides
from .systems import build_harness
from .workload import batch, gpt_module, synthetic_stream

__all__ = ["LiveBytes", "measure"]

MIB = 2**20


class LiveBytes(TorchDispatchMode):
    """Samples the bytes of live storages after every operation run under it; see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, tuple[weakref.ref[torch.UntypedStorage], str]] = {}
        for obj in gc.get_objects():
            if issubclass(type(obj), torch.Tensor):  # (type(): some objects warn when asked their __class__)
                self._add(obj, "before the step")
        self.before = self.live()
        self.peak = self.before
        self.at_peak: Counter[str] = Counter()

    def _add(self, tensor: torch.Tensor, origin: str) -> None:
        local = getattr(tensor, "_local_tensor", tensor)  # a DTensor's memory is its local shard
        try:
            storage = local.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a wrapper subclass or meta tensor: no memory of its own
            return
        key = id(storage)
        if key not in self._storages or self._storages[key][0]() is not storage:
            self._storages[key] = (weakref.ref(storage), origin)

    def _alive(self) -> list[tuple[torch.UntypedStorage, str]]:
        found = []
        for key, (ref, origin) in list(self._storages.items()):
            storage = ref()
            if storage is None:
                del self._storages[key]
            elif storage.device.type != "meta":
                found.append((storage, origin))
        return found

    def live(self) -> int:
        return sum(storage.nbytes() for storage, _ in self._alive())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves((args, kwargs, out)):
            if isinstance(value, torch.Tensor):
                self._add(value, str(func.overloadpacket.__name__))
        alive = self._alive()
        now = sum(storage.nbytes() for storage, _ in alive)
        if now > self.peak:
            self.peak = now
            self.at_peak = Counter()
            for storage, origin in alive:
                self.at_peak[origin] += storage.nbytes()
        return out


def _rank(system: System, workload: Workload, measured_steps: int, overrides: dict[str, int]) -> list[dict[str, Any]]:
    import torch.distributed as dist

    gpt = gpt_module()
    torch.manual_seed(workload.seed)
    model = gpt.GPT(gpt.gpt_config(workload.size, **{"block_size": workload.seq_len, **overrides}))
    harness = build_harness(system, model, workload)
    stream = synthetic_stream(workload.seed)
    rank, rows = dist.get_rank(), []
    for step in range(1 + measured_steps):  # the first step makes the optimizer state: not measured
        x, y = batch(stream, workload, rank, step)
        gc.collect()
        with LiveBytes() as tracker:
            harness.step(x, y, False)
        if step:
            rows.append({"before": tracker.before, "peak": tracker.peak - tracker.before,
                         "at_peak": dict(tracker.at_peak.most_common(8))})
    return rows


def measure(system: System, workload: Workload, steps: int = 2,
            overrides: Optional[dict[str, int]] = None) -> list[dict[str, Any]]:
    """Rank 0's ``before``/``peak`` bytes (and what was alive at the peak) for ``steps`` steps of ``system`` on the GPT
    preset ``workload.size`` with ``overrides`` of its fields."""
    from shardwise.testing import run_distributed

    args = (system, workload, steps, overrides or {})
    return run_distributed(_rank, workload.world_size, args=args, timeout=1800)[0]  # type: ignore[no-any-return]


def system_for(family: str, stage: int, dtype: str) -> System:
    """``family`` at ``stage`` and ``dtype``; ``peer`` is the torch system that stage is compared against."""
    if family == "peer":
        return peer_of(System("shardwise", stage, dtype))
    return System(family, stage, dtype)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="40m")
    parser.add_argument("--override", default="", help="preset fields, e.g. n_embd=1024,n_head=16,n_layer=24")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--dtype", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--world", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--stage", type=int, nargs="+", default=[3], choices=[0, 1, 2, 3])
    parser.add_argument("--systems", nargs="+", default=["shardwise", "peer"],
                        help="families, or `peer`: the stage's torch peer (DDP, ZeRO-1, FSDP2 without/with reshard)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--detail", action="store_true", help="what was alive at the peak, by the operation that made it")
    args = parser.parse_args(argv)
    print("| system | world | before MiB | step peak MiB (each step) | sum MiB |\n|---|---|---|---|---|")
    for dtype in args.dtype:
        for world in args.world:
            workload = Workload(size=args.size, world_size=world, micro_batch=args.micro_batch, seq_len=args.seq_len)
            for stage in args.stage:
                for family in args.systems:
                    _report(system_for(family, stage, dtype), workload, args)
    return 0


def _report(system: System, workload: Workload, args: argparse.Namespace) -> None:
    rows = measure(system, workload, args.steps, _overrides(args))
    peaks = ", ".join(f"{row['peak'] / MIB:.1f}" for row in rows)
    before, total = rows[-1]["before"] / MIB, (rows[-1]["before"] + rows[-1]["peak"]) / MIB
    print(f"| {system.name} | {workload.world_size} | {before:.1f} | {peaks} | {total:.1f} |", flush=True)
    if args.detail:
        print("  at peak:", {k: round(v / MIB, 1) for k, v in rows[-1]["at_peak"].items()}, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
