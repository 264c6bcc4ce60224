"""torch's AdamW on the CPU, three ways: ``fused=True``, ``foreach=True`` and the for-loop, at host-offload sizes.

``python -m benchmarks.offload_adam [--sizes 10,30,100] [--repeats 5] [--tensors 8]`` steps ``--tensors`` fp32
tensors holding ``--sizes`` million elements in all (the host home steps a sub-group of a few tensors at a time),
each variant in turn, and prints the median step time (range) and the elements per second.  It checks that the
three give the same values (they must: the same update, ordered differently).  Which one the host home of the
master store uses for its step comes from here (docs/offload.md, "The host home").
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

__all__ = ["VARIANTS", "main", "time_variant"]

#: variant name -> AdamW keyword arguments
VARIANTS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}


def _tensors(numel: int, count: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    sizes = [numel // count + (1 if i < numel % count else 0) for i in range(count)]
    params = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen) for n in sizes]
    return params, grads


def time_variant(name: str, numel: int, count: int, repeats: int) -> tuple[list[float], list[torch.Tensor]]:
    """Step times (s) of ``repeats`` AdamW steps of variant ``name`` after one warm-up step, and the values."""
    params, grads = _tensors(numel, count, 0)
    for param, grad in zip(params, grads):
        param.grad = grad
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **VARIANTS[name])  # type: ignore[arg-type]
    optimizer.step()  # creates the state
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times, params


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,30,100", help="millions of elements, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tensors", type=int, default=8)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| elements | variant | step ms, median (range) | M elements/s |")
    print("|---|---|---|---|")
    for millions in (float(s) for s in args.sizes.split(",")):
        numel = int(millions * 1e6)
        reference = None
        for name in VARIANTS:
            times, values = time_variant(name, numel, args.tensors, args.repeats)
            if reference is None:
                reference = values
            else:
                diff = max((a - b).abs().max().item() for a, b in zip(values, reference))
                assert diff <= 1e-6, f"{name} differs from fused by {diff:.3g}"
            median = statistics.median(times)
            print(f"| {millions:g}M | {name} | {median * 1e3:.0f} ({min(times) * 1e3:.0f}-{max(times) * 1e3:.0f}) "
                  f"| {numel / median / 1e6:.0f} |", flush=True)
            del values


if __name__ == "__main__":
    main()
