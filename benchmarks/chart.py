"""PNG charts, when matplotlib is installed (``pip install shardwise[bench]``); skipped otherwise."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["comparison_chart", "scaling_chart"]

_MIB = float(1 << 20)
_KINDS = ("parameters", "master_weights", "gradients", "optimizer_state")


def _pyplot(log: Callable[[str], None]) -> Any | None:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no chart (`pip install matplotlib` to get one)")
        return None
    return plt


def comparison_chart(result: dict[str, Any], path: Path, log: Callable[[str], None] = print) -> bool:
    """Step time (median, IQR bars) and per-rank state by kind, for every system; True if written."""
    plt = _pyplot(log)
    if plt is None:
        return False
    systems = [s for s in result["systems"] if "error" not in s]
    names = [s["name"] for s in systems]
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 0.4 * len(names) + 2), sharey=True)
    positions = range(len(names))
    medians = [1000 * s["step_s"]["median"] for s in systems]
    low = [m - 1000 * s["step_s"]["q1"] for m, s in zip(medians, systems)]
    high = [1000 * s["step_s"]["q3"] - m for m, s in zip(medians, systems)]
    colors = ["tab:blue" if s["family"] == "shardwise" else "tab:gray" for s in systems]
    left.barh(positions, medians, xerr=[low, high], color=colors)
    left.set_xlabel("step time, ms (median, IQR)")
    left.set_yticks(list(positions), names)
    left.invert_yaxis()
    start = [0.0] * len(systems)
    for kind in _KINDS:
        sizes = [s["state_bytes"][kind] / _MIB for s in systems]
        right.barh(positions, sizes, left=start, label=kind.replace("_", " "))
        start = [a + b for a, b in zip(start, sizes)]
    right.set_xlabel("per-rank state, MiB")
    right.legend(loc="lower right")
    w = result["workload"]
    fig.suptitle(f"GPT {w['size']} ({result['numel'] / 1e6:.1f}M), {w['world_size']} gloo ranks — shardwise (blue) vs torch")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def scaling_chart(result: dict[str, Any], path: Path, log: Callable[[str], None] = print) -> bool:
    """Step time and per-rank state against world size, one line per (size, stage); True if written."""
    plt = _pyplot(log)
    if plt is None:
        return False
    points = [p for p in result["points"] if "error" not in p]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    styles = ("-", "--", ":", "-.")
    for index, size in enumerate(dict.fromkeys(p["size"] for p in points)):
        for stage in sorted({p["stage"] for p in points}):
            line = sorted((p for p in points if p["size"] == size and p["stage"] == stage), key=lambda p: p["world_size"])
            if not line:
                continue
            worlds = [p["world_size"] for p in line]
            # Colour says the stage, line style the model size.
            style = {"marker": "o", "color": f"C{stage}", "linestyle": styles[index % len(styles)],
                     "label": f"{size} stage {stage}"}
            left.plot(worlds, [1000 * p["step_s"]["median"] for p in line], **style)
            right.plot(worlds, [p["state_total"] / _MIB for p in line], **style)
    for axis, title in ((left, "median step time, ms"), (right, "per-rank state, MiB")):
        axis.set_xlabel("world size (ranks)")
        axis.set_ylabel(title)
        axis.set_yscale("log")
        axis.set_xticks(sorted({p["world_size"] for p in points}))
    right.legend(fontsize="small", ncol=2)
    fig.suptitle(f"shardwise scaling ({result['dtype']}, micro-batch {result['micro_batch']} per rank)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
