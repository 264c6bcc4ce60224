"""The bounds that keep reading a config total and fast, and the one walk that enforces the shape ones.

A config is a few dozen keys a few levels deep (DeepSpeed's and Hugging Face's largest real files are
under 10 KB, 5 levels, a few hundred values). The bounds below are far above that, and low enough that
a hostile or corrupted file (an alias bomb, 100k-deep nesting, 200k keys) ends in a `ConfigError`
within about a second, with a message of bounded size. Every one is documented in docs/from-deepspeed.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .errors import ConfigError

__all__ = ["MAX_ACCUMULATION", "MAX_DEPTH", "MAX_ELEMENTS", "MAX_FILE_BYTES", "MAX_LOSS_SCALE", "MAX_MICRO_BATCH",
           "MAX_STEPS", "MAX_TIMEOUT_S", "MAX_TRAIN_BATCH", "MAX_VALUES", "MAX_YAML_LINES", "NO_LIMIT", "check_shape"]

#: a config file larger than this is refused before it is parsed: ~400x the largest real DeepSpeed config.
#: JSON parses at ~100 MB/s, so this bound is about memory and output, not time.
MAX_FILE_BYTES = 4 * 1024 * 1024
#: YAML also has at most this many lines plus commas (each value needs one or the other). PyYAML builds
#: ~100k values a second on a loaded 2-core host (measured: 175k one-line keys took 3.7 s), so this keeps
#: the worst YAML file under ~0.5 s; a real config has a few hundred lines.
MAX_YAML_LINES = 50_000
#: mappings and lists nested deeper than this are refused (real configs nest 5 deep, 6 with `engines`).
MAX_DEPTH = 32
#: values (mappings, lists, scalars) counted as a reader walks them, aliases and shared objects counted
#: each time they are reached: a YAML "billion laughs" file is small but reaches billions of values.
MAX_VALUES = 500_000

# ---- upper bounds of number fields: a value above one would exhaust time or memory, or overflow a
# timedelta or an int64 further down; each is far above any real setting. A field in NO_LIMIT reads a
# larger value as its bound instead of refusing it.

#: `gradient_accumulation_steps`: 2^20 micro-steps per optimizer step (17 minutes at 1 ms each)
MAX_ACCUMULATION = 2**20
#: `train_micro_batch_size_per_gpu`: samples in one forward on one rank
MAX_MICRO_BATCH = 2**20
#: `train_batch_size`: samples per optimizer step over every rank (int32, as torch indexes them)
MAX_TRAIN_BATCH = 2**31 - 1
#: bucket sizes, thresholds and distances in elements: 10^12 elements are 4 TB in fp32
MAX_ELEMENTS = 10**12
#: step counters (`steps_per_print`, `loss_scale_window`, `hysteresis`)
MAX_STEPS = 10**12
#: `loss_scale`, `min_loss_scale`: 2^64, as `initial_scale_power` <= 64
MAX_LOSS_SCALE = 2.0**64
#: timeouts in seconds: 30 days (a timeout that long never fires in practice; past ~10^14 s timedelta overflows)
MAX_TIMEOUT_S = 30 * 24 * 3600.0


#: fields where a value past the bound means "no limit": nothing is allocated or looped over in proportion to
#: the value (a bucket, prefetch or sub-group holds at most the model; a distance or a count of steps only
#: compares; a timeout only waits). Such a value is read as the field's bound, with one info line, never
#: refused: Hugging Face's own test config writes `sub_group_size: 1e14` for "one sub-group".
NO_LIMIT = frozenset({
    "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_max_live_parameters", "zero_optimization.stage3_max_reuse_distance",
    "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.sub_group_size",
    "zero_optimization.offload_param.max_in_cpu", "fp16.loss_scale_window", "fp16.hysteresis",
    "steps_per_print", "checkpoint.timeout", "comms.timeout", "dist_timeout",
})


def check_shape(data: Any, prefix: tuple[str, ...] = (), source: str | None = None) -> None:
    """Refuse data nested deeper than MAX_DEPTH, reaching more than MAX_VALUES values, or holding
    a non-finite number (inf or NaN): the first such problem is raised as a ConfigError naming the path
    (and `source`, the file it came from).

    The walk is iterative (no recursion limit to hit) and stops at the first problem, so it costs at
    most MAX_VALUES steps plus one container whatever `data` is (a cyclic dict included).
    """
    if not isinstance(data, (Mapping, list, tuple)):
        return
    stack: list[tuple[Any, tuple[str, ...]]] = [(data, prefix)]
    seen = 1
    while stack:
        container, path = stack.pop()
        if len(path) - len(prefix) >= MAX_DEPTH:
            raise ConfigError(
                f"`{_dotted(path[:len(prefix) + 3])}...` nests deeper than {MAX_DEPTH} levels (a config nests about "
                "5); remove the extra nesting", source)
        items = container.items() if isinstance(container, Mapping) else enumerate(container)
        for key, value in items:
            seen += 1
            if isinstance(value, (Mapping, list, tuple)):
                stack.append((value, (*path, str(key)[:80])))
            elif isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(
                    f"`{_dotted((*path, str(key)[:80]))}`: got {value}; expected a finite number (inf and NaN would "
                    "defeat the checks and timeouts that read it); write a finite value", source)
        if seen > MAX_VALUES:
            raise ConfigError(
                f"the config reaches more than {MAX_VALUES} values (YAML aliases and repeated objects count each "
                f"time they are used; a real config holds a few hundred); write the values out, or check that the "
                f"file is a config at all", source)


def _dotted(path: tuple[str, ...]) -> str:
    return ".".join(path) or "config"
