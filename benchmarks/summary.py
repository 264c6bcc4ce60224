"""Turn raw per-rank measurements into one summary per system, plus the cross-system checks."""

from __future__ import annotations

import statistics
from typing import Any

from .configs import System, Workload, peer_of
from .schedule import Outcome
from .theory import comm_bytes, state_bytes
from .workload import seq_len

__all__ = ["LOSS_TOLERANCE", "compare", "loss_check", "paired_time_ratio", "summarize"]

#: Largest |loss difference| at any step against the fp32 reference system.
#: fp32: same math, different kernels/reduction order.  bf16: the loss itself is
#: rounded to bf16 (spacing 1/32 between 4 and 8) and autocast peers keep some ops in fp32.
LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 6e-2}
_STATE_GOAL = 0.05  # per-rank state within 5% of ZeRO theory
_COMM_GOAL = 0.01  # collective bytes equal to theory (1%: bucket padding, the norm scalar)


def _round_times(ranks: list[dict[str, Any]]) -> list[float]:
    """One round's timed steps; a step takes as long as its slowest rank."""
    return [max(step) for step in zip(*(r["times"] for r in ranks))]


def _spread(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else (ordered[0],) * 3
    return {
        "median": statistics.median(ordered),
        "q1": q1,
        "q3": q3,
        "min": ordered[0],
        "max": ordered[-1],
        "n": len(ordered),
    }


def _loss_curve(ranks: list[dict[str, Any]]) -> list[float]:
    """The global loss per step: the mean of the ranks' losses (equal batch sizes)."""
    return [sum(step) / len(step) for step in zip(*(r["losses"] for r in ranks))]


def _state(ranks: list[dict[str, Any]]) -> dict[str, int]:
    """The state of the rank holding the most (ranks differ by bucket padding at most)."""
    return max((r["state"] for r in ranks), key=lambda s: sum(s.values()))


def _bytes_sent(runs: list[list[dict[str, Any]]], steps: int) -> float | None:
    counted = [r["bytes_sent"] for r in runs[0] if r["bytes_sent"] is not None]
    return max(counted) / steps if counted else None


def summarize(outcome: Outcome, numel: int) -> dict[str, Any]:
    """Step-time spread, throughput, memory, traffic and losses of one system."""
    system, workload = outcome.system, outcome.workload
    summary: dict[str, Any] = {"name": system.name, "family": system.family, "stage": system.stage, "dtype": system.dtype}
    if system.is_shardwise:
        summary["peer"] = peer_of(system).name
    if not outcome.runs:
        summary["error"] = outcome.error or "no run finished"
        return summary
    if outcome.error is not None:
        # Failed in a later round (and was dropped from the rest): keep the rounds that finished.
        summary["failure"] = outcome.error
    summary.update(_timing(outcome))
    summary.update(_memory(outcome.runs, system, workload, numel))
    summary.update(_traffic(outcome.runs, system, workload, numel))
    curves = [_loss_curve(ranks) for ranks in outcome.runs]
    summary["loss_curve"] = curves[0]
    summary["final_loss"] = curves[0][-1]
    # Every round trains the same steps from the same seed: rounds must agree exactly.
    summary["round_loss_spread"] = max(abs(a - b) for c in curves for a, b in zip(c, curves[0]))
    summary["setup_s"] = statistics.median(r["setup_s"] for ranks in outcome.runs for r in ranks)
    return summary


def _timing(outcome: Outcome) -> dict[str, Any]:
    by_round = {str(index): _round_times(ranks) for index, ranks in zip(outcome.rounds, outcome.runs)}
    spread = _spread([t for times in by_round.values() for t in times])
    workload = outcome.workload
    tokens = workload.world_size * workload.micro_batch * seq_len(workload)
    return {"step_s": spread, "tokens_per_s": tokens / spread["median"], "step_times": by_round}


def _memory(runs: list[list[dict[str, Any]]], system: System, workload: Workload, numel: int) -> dict[str, Any]:
    state = _state(runs[0])
    theory = state_bytes(system.stage, system.dtype, numel, workload.world_size)
    total, expected = sum(state.values()), sum(theory.values())
    # Only a system built first in its processes has a clean RSS figure (see worker.py).
    clean = [r for ranks in runs for r in ranks if r.get("rss_clean", True)]
    return {
        "state_bytes": state,
        "state_total": total,
        "state_theory": theory,
        "state_theory_total": expected,
        "state_vs_theory": total / expected,
        "peak_rss": max(r["peak_rss"] for r in clean) if clean else None,
        "rss_growth": max(r["peak_rss"] - r["baseline_rss"] for r in clean) if clean else None,
    }


def _traffic(runs: list[list[dict[str, Any]]], system: System, workload: Workload, numel: int) -> dict[str, Any]:
    transport = next((r["transport"] for r in runs[0] if r.get("transport")), "gloo") if runs else "gloo"
    theory = comm_bytes(system, numel, workload.world_size, transport)
    sent = _bytes_sent(runs, workload.steps)
    ratio: float | None = None
    if sent is not None:
        # One rank: nothing to send, and nothing sent is exactly the theory.
        ratio = sent / theory if theory > 0 else (1.0 if sent == 0 else float("inf"))
    return {"sent_per_step": sent, "sent_theory": theory, "sent_vs_theory": ratio}


def loss_check(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Every system's largest per-step loss difference against the fp32 reference."""
    done = [s for s in summaries if "error" not in s]
    fp32 = [s for s in done if s["dtype"] == "fp32"]
    reference = next((s for s in fp32 if s["name"] == "ddp-fp32"), fp32[0] if fp32 else None)
    if reference is None:
        return {"reference": None, "agree": False, "systems": {}}
    rows = {}
    for s in done:
        diff = max(abs(a - b) for a, b in zip(s["loss_curve"], reference["loss_curve"]))
        tolerance = LOSS_TOLERANCE[s["dtype"]]
        rows[s["name"]] = {"max_abs_diff": diff, "tolerance": tolerance, "agree": diff <= tolerance}
    return {"reference": reference["name"], "agree": all(r["agree"] for r in rows.values()), "systems": rows}


def compare(summaries: list[dict[str, Any]], against: str = "torch") -> list[dict[str, Any]]:
    """One row per shardwise system: its ratios against its torch peer (or DeepSpeed) and the goals."""
    by_name = {s["name"]: s for s in summaries}
    rows = []
    for mine in summaries:
        if mine["family"] != "shardwise":
            continue
        name = mine["peer"] if against == "torch" else System(against, mine["stage"], mine["dtype"]).name
        peer = by_name.get(name)
        row: dict[str, Any] = {"stage": mine["stage"], "dtype": mine["dtype"], "shardwise": mine["name"], "peer": name}
        if "error" in mine or peer is None or "error" in peer:
            row["error"] = mine.get("error") or (peer or {}).get("error", "peer not run")
            rows.append(row)
            continue
        row.update(_ratios(mine, peer))
        rows.append(row)
    return rows


def paired_time_ratio(mine: dict[str, Any], peer: dict[str, Any]) -> float | None:
    """Median of step-by-step time ratios, pairing the i-th timed step of the same round.

    With ``isolation="pair"`` the two steps ran back to back in the same
    processes, so a change in the machine's load cancels out of each ratio;
    the ratio of the two medians does not have that protection.
    """
    ratios = [
        a / b
        for index, times in mine["step_times"].items()
        for a, b in zip(times, peer["step_times"].get(index, []))
    ]
    return statistics.median(ratios) if ratios else None


def _ratios(mine: dict[str, Any], peer: dict[str, Any]) -> dict[str, Any]:
    medians = mine["step_s"]["median"] / peer["step_s"]["median"]
    paired = paired_time_ratio(mine, peer)
    time_ratio = paired if paired is not None else medians
    sent_ratio = mine["sent_vs_theory"]
    return {
        "time_ratio": time_ratio,
        "time_ratio_of_medians": medians,
        "state_ratio": mine["state_total"] / peer["state_total"],
        "rss_growth_ratio": _ratio(mine["rss_growth"], peer["rss_growth"]),
        "goal_time": time_ratio <= 1.0,
        "goal_state": abs(mine["state_vs_theory"] - 1.0) <= _STATE_GOAL,
        "goal_comm": sent_ratio is not None and abs(sent_ratio - 1.0) <= _COMM_GOAL,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / max(b, 1)
