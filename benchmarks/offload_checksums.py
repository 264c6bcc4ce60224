"""What verifying the NVMe offload files costs: digest speed, and the step time with digests on and off.

``python -m benchmarks.offload_checksums [--params 10] [--steps 5] [--pairs 5] [--stage 3] [--nvme DIR]``

1. Throughput (MB/s) of each candidate digest on the buffer sizes the offload moves (a sub-group's run of one
   kind: ``sub_group_size`` x 4 bytes; a unit's shard): crc32c (the ``crc32c`` package), crc32c
   (``google-crc32c``, which takes only read-only ``bytes``: a copy first), XXH3 and XXH64 (``xxhash``),
   and ``zlib.crc32``; the median of 5 timings, with their range.
2. The step time of a 2-rank job offloading to NVMe (stage 2: the optimizer; stage 3: optimizer and
   parameters), paired: each pair trains one engine with the digests and one without (``Sums`` made a no-op),
   in alternating order, on the same machine at the same time; the median step of each, their difference per
   pair, and its median and range.  The figures in docs/offload.md come from here.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
import zlib
from typing import Any, Callable, Iterator

import torch

from shardwise.testing import run_distributed
from shardwise.zero.offload import files as nvme_sums

from .offload import measure

__all__ = ["digest_speeds", "main", "paired_steps"]


def _candidates() -> dict[str, Callable[[memoryview], int]]:
    found: dict[str, Callable[[memoryview], int]] = {"zlib.crc32": zlib.crc32}
    with contextlib.suppress(ImportError):
        import crc32c

        found["crc32c (crc32c)"] = crc32c.crc32c
    with contextlib.suppress(ImportError):
        import google_crc32c

        found["crc32c (google-crc32c, a bytes copy first)"] = lambda data: google_crc32c.value(bytes(data))
    import xxhash

    found["XXH3-64 (xxhash)"] = xxhash.xxh3_64_intdigest
    found["XXH64 (xxhash)"] = xxhash.xxh64_intdigest
    return found


def digest_speeds(sizes: list[int]) -> dict[str, dict[int, tuple[float, float, float]]]:
    """Per candidate, per size in bytes: (median, lowest, highest) MB/s over 5 timings."""
    result: dict[str, dict[int, tuple[float, float, float]]] = {}
    for name, digest in _candidates().items():
        for size in sizes:
            data = torch.randn(size // 4).view(torch.uint8).numpy().data
            digest(data)
            repeats = max(3, int(256e6 // size))
            speeds = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(repeats):
                    digest(data)
                speeds.append(size * repeats / (time.perf_counter() - start) / 1e6)
            result.setdefault(name, {})[size] = (statistics.median(speeds), min(speeds), max(speeds))
    return result


@contextlib.contextmanager
def _digests(on: bool, spent: list[float]) -> Iterator[None]:
    """Digests taken and checked (``on``; the seconds and bytes each takes are added to ``spent``), or every
    write and read left unrecorded and unchecked."""
    if on:
        real_digest = nvme_sums.digest

        def timed(data: memoryview) -> int:
            start = time.perf_counter()
            value = real_digest(data)
            spent.append(time.perf_counter() - start)
            spent.append(len(data))
            return value

        nvme_sums.digest = timed
        try:
            yield
        finally:
            nvme_sums.digest = real_digest
        return
    real = nvme_sums.Sums.wrote, nvme_sums.Sums.check
    nvme_sums.Sums.wrote = lambda self, *args: None  # type: ignore[method-assign,assignment]
    nvme_sums.Sums.check = lambda self, *args, **kwargs: None  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nvme_sums.Sums.wrote, nvme_sums.Sums.check = real  # type: ignore[method-assign]


def _pairs(millions: int, steps: int, pairs: int, stage: int, nvme: str,
           sub_group: int) -> list[tuple[float, float, float, float]]:
    """Per pair: step ms with digests, step ms without, ms spent in digests per step and MB they read per step
    (both over every step, the two warm-up steps and `initialize`'s writes included: an upper bound)."""
    what = "optimizer" if stage == 2 else "both"
    result = []
    for pair in range(pairs):
        times: dict[bool, float] = {}
        spent: list[float] = []
        for on in ((True, False) if pair % 2 == 0 else (False, True)):
            with _digests(on, spent):
                times[on] = measure(millions, steps, nvme, sub_group, 4, stage, what)["step_ms"]
        per_step = steps + 2
        result.append((times[True], times[False], 1e3 * sum(spent[0::2]) / per_step, sum(spent[1::2]) / 1e6 / per_step))
    return result


def _spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def paired_steps(millions: int, steps: int, pairs: int, stage: int, nvme: str, sub_group: int) -> dict[str, Any]:
    """Rank 0's pairs; the median and range of the difference (ms, and % of the step without digests), and of
    the time the digests themselves took per step (ms, and % of the step with them)."""
    rows = run_distributed(_pairs, 2, args=(millions, steps, pairs, stage, nvme, sub_group), timeout=3000)[0]
    return {"pairs": rows, "added_ms": _spread([on - off for on, off, _, _ in rows]),
            "added_pct": _spread([100 * (on - off) / off for on, off, _, _ in rows]),
            "digest_ms": _spread([spent for _, _, spent, _ in rows]),
            "digest_pct": _spread([100 * spent / on for on, _, spent, _ in rows]),
            "digest_mb": _spread([mb for _, _, _, mb in rows])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=10, help="millions of parameters (1000x1000 layers)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--stage", type=int, choices=(2, 3), default=2)
    parser.add_argument("--sub-group", type=int, default=1_000_000)
    parser.add_argument("--nvme", default=None, help="a folder on the disk to offload to (default: a temporary one)")
    args = parser.parse_args(argv)
    sizes = [64 << 10, 1 << 20, 4 * args.sub_group]
    for name, speeds in digest_speeds(sizes).items():
        cells = ", ".join(f"{size >> 10} KiB {m:,.0f} ({lo:,.0f}-{hi:,.0f})" for size, (m, lo, hi) in speeds.items())
        print(f"{name}: MB/s {cells}")
    with tempfile.TemporaryDirectory(dir=args.nvme) as nvme:
        result = paired_steps(args.params, args.steps, args.pairs, args.stage, nvme, args.sub_group)
    for on, off, spent, mb in result["pairs"]:
        print(f"stage {args.stage}: step {on:.1f} ms with digests ({spent:.1f} ms of them hashing {mb:.0f} MB), "
              f"{off:.1f} ms without")
    count = len(result["pairs"])
    print("over {} pairs: step with - without {:+.1f} ms (range {:+.1f} to {:+.1f}), {:+.1f}% ({:+.1f}% to {:+.1f}%)"
          .format(count, *result["added_ms"], *result["added_pct"]))
    print("hashing per step: {:.1f} ms (range {:.1f} to {:.1f}), {:.1f}% of the step ({:.1f}% to {:.1f}%), "
          "{:.0f} MB".format(*result["digest_ms"], *result["digest_pct"], result["digest_mb"][0]))


if __name__ == "__main__":
    main()
