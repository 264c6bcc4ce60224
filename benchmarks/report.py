"""Markdown tables and the JSON file from the summaries (see :mod:`benchmarks.summary`)."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from shardwise.optim.hardware import bf16_support, cpu_model

__all__ = ["comparison_markdown", "machine", "scaling_markdown", "write_json"]

_MIB = float(1 << 20)


def machine() -> dict[str, Any]:
    """Where the numbers were taken: CPU, cores, memory, torch, load."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(_meminfo_kib("MemTotal") / (1 << 20), 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        # bf16 figures depend on it by an order of magnitude: said next to each of them
        "bf16_support": bf16_support(),
    }


def _dtype_cell(dtype: str, machine: dict[str, Any]) -> str:
    """A table's dtype cell: bf16 carries the CPU's bf16 support (results from before it was recorded: plain)."""
    support = machine.get("bf16_support")
    return f"bf16 ({support})" if dtype == "bf16" and support else dtype


def _meminfo_kib(field: str) -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")


# ----------------------------------------------------------------- formatting
def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f}"


def _mib(nbytes: float | None) -> str:
    return "—" if nbytes is None else f"{nbytes / _MIB:.1f}"


def _x(ratio: float | None, digits: int = 2) -> str:
    return "—" if ratio is None else f"{ratio:.{digits}f}×"


def _ok(flag: bool) -> str:
    return "✓" if flag else "✗"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


# ----------------------------------------------------------------- comparison
_RATIO_NOTE = (
    "time × (paired): median over timed steps of shardwise's step time / the peer's step time in the same "
    "round (with `--isolation pair`, back to back in the same processes). state: per-rank bytes of parameters, "
    "master weights and optimizer state after a step, gradients after backward. RSS growth: peak resident "
    "memory minus resident memory before the model was built."
)


def comparison_markdown(result: dict[str, Any]) -> str:
    """The whole comparison report: header, ratios, every system, goals, losses."""
    lines = _header(result)
    lines += ["", "### shardwise against its torch peer", ""]
    lines += _ratio_table(result["comparisons"], {s["name"]: s for s in result["systems"]}, result["machine"])
    lines += ["", _RATIO_NOTE]
    if result.get("deepspeed_comparisons"):
        lines += ["", "### shardwise against DeepSpeed (same stage)", ""]
        lines += _ratio_table(result["deepspeed_comparisons"], {s["name"]: s for s in result["systems"]},
                              result["machine"])
    lines += ["", "### Every system", ""]
    lines += _systems_table(result["systems"], result["loss_check"])
    lines += ["", "### Goals", ""]
    lines += _goals(result["comparisons"], result["systems"])
    lines += ["", "### Losses", ""]
    lines += _losses(result["loss_check"])
    lines += _failures(result["systems"])
    return "\n".join(lines) + "\n"


def _failures(systems: list[dict[str, Any]]) -> list[str]:
    failed = [s for s in systems if "error" in s or "failure" in s]
    if not failed:
        return []
    lines = ["", "### Failures", ""]
    for s in failed:
        text = s.get("error") or s["failure"]
        when = "every round" if "error" in s else f"a later round (figures above from {s['step_s']['n']} timed steps)"
        lines.append(f"- `{s['name']}` failed in {when}: {text.strip().splitlines()[-1][:300]}")
    return lines


def _header(result: dict[str, Any]) -> list[str]:
    w, m = result["workload"], result["machine"]
    return [
        f"## GPT {w['size']} ({result['numel'] / 1e6:.2f}M parameters) on {w['world_size']} gloo ranks",
        "",
        (f"- date: {m['date']}; machine: {m['cpu']} ({m.get('bf16_support', 'bf16 support not recorded')}),"
         f" {m['cores']} cores, {m['memory_gib']} GiB;"
         f" torch {m['torch']}; {result['threads']} thread(s) per rank"),
        f"- command: `{result['command']}`",
        (f"- workload: micro-batch {w['micro_batch']} × {result['seq_len']} tokens per rank, AdamW lr {w['lr']},"
         f" {w['warmup']} warm-up + {w['steps']} timed steps per round, {result['rounds']} interleaved round(s)"
         f" (isolation: {result['isolation']}), seed {w['seed']}"),
        f"- load average before / after: {_load(result['load_before'])} / {_load(result['load_after'])}",
    ]


def _load(load: Any) -> str:
    return "—" if not load else ", ".join(f"{v:.1f}" for v in load)


def _ratio_table(rows: list[dict[str, Any]], by_name: dict[str, dict[str, Any]], machine: dict[str, Any]) -> list[str]:
    header = ["stage", "dtype", "peer", "step ms (shardwise / peer)", "time × (paired)",
              "state MiB/rank (shardwise / peer)", "state ×", "RSS growth MiB (shardwise / peer)", "RSS ×"]
    body = []
    for row in rows:
        lead = [str(row["stage"]), _dtype_cell(row["dtype"], machine), row["peer"]]
        if "error" in row:
            body.append(lead + [f"error: {row['error'].splitlines()[0][:80]}"] + [""] * 5)
            continue
        mine, peer = by_name[row["shardwise"]], by_name[row["peer"]]
        body.append(lead + [
            f"{_ms(mine['step_s']['median'])} / {_ms(peer['step_s']['median'])}", _x(row["time_ratio"]),
            f"{_mib(mine['state_total'])} / {_mib(peer['state_total'])}", _x(row["state_ratio"]),
            f"{_mib(mine['rss_growth'])} / {_mib(peer['rss_growth'])}", _x(row["rss_growth_ratio"]),
        ])
    return _table(header, body)


def _systems_table(systems: list[dict[str, Any]], losses: dict[str, Any]) -> list[str]:
    header = ["system", "step ms median [IQR] (min–max, n)", "tokens/s", "peak RSS MiB", "RSS growth MiB",
              "params / master / grads / optim MiB", "state MiB (theory)", "state × theory",
              "sent MiB/step (theory)", "sent × theory", "final loss", "max |Δloss|"]
    body = []
    for s in systems:
        if "error" in s:
            body.append([s["name"], f"error: {s['error'].splitlines()[0][:100]}"] + [""] * 10)
            continue
        st, sb = s["step_s"], s["state_bytes"]
        parts = " / ".join(_mib(sb[k]) for k in ("parameters", "master_weights", "gradients", "optimizer_state"))
        diff = losses["systems"].get(s["name"], {}).get("max_abs_diff")
        sent = _mib(s["sent_per_step"]) if s["sent_per_step"] is not None else "not counted"
        body.append([
            s["name"],
            f"{_ms(st['median'])} [{_ms(st['q1'])}–{_ms(st['q3'])}] ({_ms(st['min'])}–{_ms(st['max'])}, {st['n']})",
            f"{s['tokens_per_s']:.0f}", _mib(s["peak_rss"]), _mib(s["rss_growth"]), parts,
            f"{_mib(s['state_total'])} ({_mib(s['state_theory_total'])})", _x(s["state_vs_theory"]),
            f"{sent} ({_mib(s['sent_theory'])})", _x(s["sent_vs_theory"]),
            f"{s['final_loss']:.5f}", "—" if diff is None else f"{diff:.1e}",
        ])
    return _table(header, body)


def _goals(rows: list[dict[str, Any]], systems: list[dict[str, Any]]) -> list[str]:
    by_name = {s["name"]: s for s in systems}
    lines = ["Step time ≤ 1.0× the peer; per-rank state within 5% of ZeRO theory; collective bytes equal to theory.", ""]
    header = ["stage", "dtype", "time ≤ peer", "state ≈ theory", "bytes = theory"]
    body = []
    for row in rows:
        if "error" in row:
            body.append([str(row["stage"]), row["dtype"], "error", "", ""])
            continue
        mine = by_name[row["shardwise"]]
        body.append([
            str(row["stage"]), row["dtype"],
            f"{_ok(row['goal_time'])} {_x(row['time_ratio'], 3)}",
            f"{_ok(row['goal_state'])} {_x(mine['state_vs_theory'], 3)}",
            f"{_ok(row['goal_comm'])} {_x(mine['sent_vs_theory'], 3)}",
        ])
    return lines + _table(header, body)


def _losses(check: dict[str, Any]) -> list[str]:
    if check["reference"] is None:
        return ["No fp32 system finished: no loss reference."]
    verdict = "all systems agree" if check["agree"] else "SOME SYSTEMS DISAGREE"
    bad = [f"{n} ({r['max_abs_diff']:.2e} > {r['tolerance']:.0e})" for n, r in check["systems"].items() if not r["agree"]]
    tolerances = "fp32 1e-4, bf16 6e-2"
    lines = [f"Largest per-step loss difference against `{check['reference']}` (tolerance {tolerances}): {verdict}."]
    return lines + ([f"Disagreeing: {', '.join(bad)}."] if bad else [])


# -------------------------------------------------------------------- scaling
def scaling_markdown(result: dict[str, Any]) -> str:
    """Step time and per-rank memory against model size and world size."""
    points = result["points"]
    stages = sorted({p["stage"] for p in points})
    keys = sorted({(p["numel"], p["size"], p["world_size"]) for p in points})
    find = {(p["size"], p["world_size"], p["stage"]): p for p in points}
    lines = [
        (f"## Scaling: shardwise {result['dtype']}, micro-batch {result['micro_batch']} per rank"
         f" (weak scaling), {result['threads']} thread(s) per rank on {result['machine']['cores']} cores"),
        "",
        f"- date: {result['machine']['date']}; command: `{result['command']}`",
        ("- world sizes above the core count oversubscribe the CPU: their step times show contention, "
         "their memory and traffic are exact."),
        "",
        "Median step time, ms:",
        "",
    ]
    head = ["size", "params", "world"] + [f"stage {s}" for s in stages]
    lines += _table(head, [_scale_row(k, stages, find, _scale_time) for k in keys])
    lines += ["", "Per-rank state MiB (peak RSS growth MiB):", ""]
    lines += _table(head, [_scale_row(k, stages, find, _scale_memory) for k in keys])
    return "\n".join(lines) + "\n"


def _scale_row(key: tuple[int, str, int], stages: list[int], find: dict[Any, Any], cell: Any) -> list[str]:
    numel, size, world = key
    row = [size, f"{numel / 1e6:.2f}M", str(world)]
    for stage in stages:
        point = find.get((size, world, stage))
        row.append("—" if point is None else ("error" if "error" in point else cell(point)))
    return row


def _scale_time(point: dict[str, Any]) -> str:
    return _ms(point["step_s"]["median"])


def _scale_memory(point: dict[str, Any]) -> str:
    return f"{_mib(point['state_total'])} ({_mib(point['rss_growth'])})"
