"""A cost model for ZeRO stages 0-3: per-GPU memory and step time from 8 to 1,024 GPUs.

``python -m benchmarks.model --table``      the scale table (125M / 1.3B / 13B × 8 / 64 / 1,024 GPUs)
``python -m benchmarks.model --validate``   predicted vs measured step times on this machine
``python -m benchmarks.model --zero-paper`` the ZeRO paper's memory figures, reproduced

**Step time** = compute + optimizer + the part of each collective not hidden
behind compute, plus host work per parameter tensor and per gradient byte where it is measured.  Compute is training FLOPs at a sustained rate: 6Ψ per token
for the weights plus 12·L·s·h per token for attention scores (Kaplan et al.
2020; Narayanan et al. 2021), one third forward, two thirds backward.  The
optimizer is memory-bound: bytes touched per owned parameter over memory
bandwidth.  Collectives follow :mod:`benchmarks.collectives` (ring α-β) and
what each stage does (``docs/zero.md``):

* stage 0: all-reduce the fp32 gradients during backward;
* stages 1-2: reduce-scatter (NCCL, shared memory) or all-reduce (gloo's sockets) the fp32 gradients
  during backward, then all-gather the updated 16-bit parameters, which
  shardwise overlaps with the next forward;
* stage 3: all-gather the parameters in forward and again in backward, and
  reduce-scatter the gradients in backward.

Where a device computes while its links move data (GPUs: NCCL runs on its own
stream) a collective is hidden up to the compute it runs beside, and the last
bucket is always exposed.  Where it cannot (the ranks of this machine share
its 2 cores with the compute) every collective is exposed.

**Memory** per GPU: the ZeRO paper's model states (mixed precision with Adam:
2Ψ parameters + 2Ψ gradients + 12Ψ fp32 master, momentum and variance;
stage 1 divides the 12Ψ by N, stage 2 the gradients too, stage 3 the
parameters too), plus activations with activation checkpointing (every
layer's 16-bit input, 2·b·s·h bytes, and one layer's full activations,
b·s·h·(34 + 5·a·s/h) bytes: Korthikanti et al. 2022), plus stage 3's live
gathered layers and the reduction buckets.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .collectives import Link, all_gather, all_reduce, reduce_scatter

__all__ = ["CLUSTERS", "Cluster", "Device", "Job", "Transformer", "memory_per_gpu", "step_time"]

GB = 1e9


@dataclass(frozen=True)
class Transformer:
    """A GPT: ``layers`` blocks of width ``hidden`` with ``heads`` heads, ``seq`` tokens per sequence."""

    name: str
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int = 50257
    params: int = 0  # 0: 12·L·h² + V·h (+ positions); set for a model counted exactly
    parameter_tensors: int = 0  # 0: 12 per block (6 weights, 6 biases and LayerNorm vectors) + 4
    gathered_units: int = 0  # 0: 4 per block + 2 (see ``units``)

    @property
    def tensors(self) -> int:
        """Parameter tensors: what per-tensor host work (hooks, the optimizer's loop) scales with."""
        return self.parameter_tensors or 12 * self.layers + 4

    @property
    def units(self) -> int:
        """Stage-3 gathers per pass: four weight matrices per block and the two embeddings (LayerNorms and
        biases stay whole under ``stage3_param_persistence_threshold``)."""
        return self.gathered_units or 4 * self.layers + 2

    @property
    def numel(self) -> int:
        if self.params:
            return self.params
        return 12 * self.layers * self.hidden**2 + (self.vocab + self.seq) * self.hidden

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6Ψ for the weights and 12·L·s·h for attention scores."""
        return 6 * self.numel + 12 * self.layers * self.seq * self.hidden


@dataclass(frozen=True)
class Device:
    """Sustained compute (FLOP/s = peak × utilisation), memory, memory bandwidth; where the figures come from."""

    name: str
    flops: float
    memory: float
    bandwidth: float
    source: str
    #: seconds of host work per parameter tensor per step that FLOPs and bytes do not explain (Python hooks,
    #: the optimizer's per-tensor loop, small kernels); measured here, 0 for the GPU presets, where it runs
    #: ahead of the device
    host_per_tensor: float = 0.0
    #: seconds per gradient byte per step beyond the modelled copies (passes over memory a stage makes that
    #: the model does not list: stage 2 stages and divides its gradients, stage 3 allocates fresh buffers;
    #: with 2 ranks also their contention for the cores and the memory bus); measured here, 0 for the GPU
    #: presets
    host_per_byte: float = 0.0
    #: seconds per stage-3 unit per step that ranks spend waiting for each other at its collectives (the
    #: unit's gathers and reduce-scatter); measured here for 2 ranks, 0 for the GPU presets
    host_per_unit: float = 0.0


@dataclass(frozen=True)
class Cluster:
    """Devices, ``per_node`` to a node joined by ``intra``, nodes joined by ``inter``."""

    name: str
    device: Device
    per_node: int
    intra: Link
    inter: Link
    #: whether collectives run beside compute (a GPU's own stream) or take its cores (gloo on CPU)
    overlaps: bool
    #: what a collective staged through a copy costs where that differs from ``intra`` (shared memory on
    #: this machine reads stages 0-1's shared gradient buffer in place, but stages every all-gather and
    #: stages 2-3's reductions through its slots); None: the same
    staged: Optional[Link] = None

    def staged_link(self, n: int) -> Link:
        """The link staged collectives over ``n`` ranks see."""
        return self.staged if self.staged is not None and n <= self.per_node else self.link(n)

    def link(self, n: int) -> Link:
        """A ring over ``n`` ranks: bandwidth of its slowest hop; latency of a two-level ring.

        Across nodes NCCL does not pay N−1 inter-node latencies per collective (it runs rings
        inside nodes and across them, and trees for small messages), so the latency term is
        (p−1)·α_intra + (N/p−1)·α_inter for p devices per node, spread over the N−1 hops.
        """
        if n <= self.per_node:
            return self.intra
        nodes = math.ceil(n / self.per_node)
        latency = (self.per_node - 1) * self.intra.alpha + (nodes - 1) * self.inter.alpha
        return Link(self.inter.name, latency / (n - 1), self.inter.beta, self.inter.source)


@dataclass(frozen=True)
class Job:
    """What is trained: the model, ``sequences`` per GPU per step, precision, bucket size."""

    model: Transformer
    sequences: int = 1
    #: bytes per parameter as computed and gathered (2: bf16), as reduced (4: fp32)
    param_bytes: int = 2
    grad_bytes: int = 4
    #: optimizer state bytes per parameter beyond the 16-bit copy (12: fp32 master, m, v; 8 in fp32 training)
    state_bytes: int = 12
    bucket: int = 5_000_000
    checkpointing: bool = True
    #: stages 1-2 average by all-reduce (gloo) instead of reduce-scatter (NCCL)
    all_reduce_for_scatter: bool = False

    @property
    def buckets(self) -> int:
        return max(1, math.ceil(self.model.numel / self.bucket))


# ---------------------------------------------------------------- presets
# Accelerators: bf16 dense peak from the vendors' data sheets, at 40% model FLOPs utilisation
# (large-model training typically reaches 35-55% on these parts; Chowdhery et al. 2022 report 46%).
_MFU = 0.40
A100 = Device("A100 80GB SXM", 312e12 * _MFU, 80 * GB, 2.0e12,
              "NVIDIA A100 data sheet: 312 TFLOP/s bf16 dense, 80 GB, 2.0 TB/s HBM2e; 40% MFU")
H100 = Device("H100 80GB SXM", 989e12 * _MFU, 80 * GB, 3.35e12,
              "NVIDIA H100 data sheet: 989 TFLOP/s bf16 dense, 80 GB, 3.35 TB/s HBM3; 40% MFU")

# Links: effective ring bus bandwidth as NCCL's all_reduce_perf reports it for large messages, and its
# small-message latency per hop.
NVLINK4 = Link("NVLink 4 (8×H100, NVSwitch)", 5e-6, 1 / 360e9,
               "NVLink 4: 900 GB/s per GPU both ways; nccl-tests all-reduce bus bandwidth ~360 GB/s on 8×H100")
NVLINK3 = Link("NVLink 3 (8×A100, NVSwitch)", 5e-6, 1 / 230e9,
               "NVLink 3: 600 GB/s per GPU both ways; nccl-tests all-reduce bus bandwidth ~230 GB/s on 8×A100")
IB100 = Link("InfiniBand 100 Gb/s per GPU", 8e-6, 1 / 11e9,
             "HDR100/EDR: 12.5 GB/s line rate, ~11 GB/s achieved bus bandwidth per rail")
IB400 = Link("InfiniBand 400 Gb/s per GPU", 8e-6, 1 / 45e9,
             "NDR: 50 GB/s line rate, ~45 GB/s achieved bus bandwidth per rail (one NIC per GPU, as DGX H100)")

CLUSTERS = {
    "a100-ib100": Cluster("A100, NVLink 3 in a node, 100 Gb/s InfiniBand per GPU", A100, 8, NVLINK3, IB100, True),
    "h100-ib400": Cluster("H100, NVLink 4 in a node, 400 Gb/s InfiniBand per GPU", H100, 8, NVLINK4, IB400, True),
}

MODELS = {
    "125M": Transformer("125M", 12, 768, 12, 2048),
    "1.3B": Transformer("1.3B", 24, 2048, 16, 2048),
    "13B": Transformer("13B", 40, 5120, 40, 2048),
}

#: measured on this machine by ``python -m benchmarks.calibrate`` (2 gloo ranks on loopback, 1 torch thread)
HERE = Path(__file__).with_name("calibration.json")


# ---------------------------------------------------------------- memory
def memory_per_gpu(job: Job, stage: int, n: int) -> dict[str, float]:
    """Bytes per GPU at ZeRO ``stage`` on ``n`` GPUs, by kind (see the module docstring)."""
    psi, m = job.model.numel, job.model
    params, grads, states = job.param_bytes * psi, job.param_bytes * psi, job.state_bytes * psi
    result = {
        "parameters": params / n if stage >= 3 else params,
        "gradients": grads / n if stage >= 2 else grads,
        "optimizer_states": states / n if stage >= 1 else states,
    }
    b, s, h, a = job.sequences, m.seq, m.hidden, m.heads
    layer = b * s * h * (34 + 5 * a * s / h)  # bytes, 16-bit activations of one layer
    stored = m.layers * 2 * b * s * h if job.checkpointing else m.layers * layer
    result["activations"] = stored + (layer if job.checkpointing else 0)
    gathered = 2 * 12 * h * h * job.param_bytes if stage == 3 else 0  # two layers live (one prefetched)
    result["buffers"] = gathered + 2 * job.bucket * job.grad_bytes
    return result


def model_states(psi: float, stage: int, n: int, k: int = 12) -> float:
    """The ZeRO paper's model-state bytes per device: (2 + 2 + K)Ψ partitioned by stage (its Figure 1)."""
    if stage == 0:
        return (4 + k) * psi
    if stage == 1:
        return 4 * psi + k * psi / n
    if stage == 2:
        return 2 * psi + (2 + k) * psi / n
    return (4 + k) * psi / n


# ---------------------------------------------------------------- time
def step_time(job: Job, stage: int, n: int, cluster: Cluster) -> dict[str, float]:
    """Seconds per optimizer step at ``stage`` on ``n`` devices, by part (see the module docstring)."""
    psi, glink, buckets = job.model.numel, cluster.staged_link(n), job.buckets
    link = cluster.link(n) if stage < 2 else glink  # stages 2-3 reduce from buffers of their own
    compute = job.model.flops_per_token() * job.sequences * job.model.seq / cluster.device.flops
    forward, backward = compute / 3, 2 * compute / 3
    owned = psi if stage == 0 else psi / n
    optimizer = owned * (job.state_bytes + job.grad_bytes + job.param_bytes) * 2 / cluster.device.bandwidth
    grads, params = job.grad_bytes * psi, job.param_bytes * psi
    if stage == 0 or (stage in (1, 2) and job.all_reduce_for_scatter):
        reduce = all_reduce(grads, n, link, buckets)
    else:
        reduce = reduce_scatter(grads, n, link, buckets)
    if stage == 0:
        exposed = _hidden_behind(reduce, backward, buckets, cluster)
    elif stage in (1, 2):
        gather = all_gather(params, n, glink, buckets)
        exposed = _hidden_behind(reduce, backward, buckets, cluster) + _hidden_behind(gather, forward, buckets, cluster)
    else:
        units = job.model.units
        forward_gather = all_gather(params, n, glink, units)
        backward_comm = all_gather(params, n, glink, units) + reduce_scatter(grads, n, link, units)
        exposed = _hidden_behind(forward_gather, forward, units, cluster) + \
            _hidden_behind(backward_comm, backward, units, cluster)
    copies = _copied_bytes(job, stage, n) / cluster.device.bandwidth
    host = job.model.tensors * cluster.device.host_per_tensor + grads * cluster.device.host_per_byte
    if stage == 3:
        host += job.model.units * cluster.device.host_per_unit
    return {"compute": compute, "optimizer": optimizer, "copies": copies, "host": host, "exposed_comm": exposed,
            "total": compute + optimizer + copies + host + exposed}


def _copied_bytes(job: Job, stage: int, n: int = 1) -> float:
    """Bytes a stage moves per step beside the math: stages 0-1 copy each gradient into the flat buffer
    (as DDP copies into its buckets); stage 2 stages gradients into its buckets; stage 3 writes every unit's
    full parameters twice (forward, backward) and its gradients into a flat buffer; every stage reads the
    gradients it owns once more for their norm (clipping, the overflow check, ``get_global_grad_norm()``)."""
    psi = job.model.numel
    owned = psi if stage == 0 else psi / n
    norm = job.grad_bytes * owned
    if stage == 3:
        return (2 * job.param_bytes + job.grad_bytes) * psi + norm
    return job.grad_bytes * psi + norm


def _hidden_behind(comm: float, compute: float, pieces: int, cluster: Cluster) -> float:
    """The exposed part of ``comm`` sent in ``pieces`` beside ``compute``: the last piece, and what does not fit."""
    if not cluster.overlaps:
        return comm
    last = comm / pieces
    return last + max(0.0, comm - last - compute)


# ---------------------------------------------------------------- the scale table
#: elements per reduction bucket in the scale table: 100 MB of fp32 gradients (at thousands of GPUs
#: shardwise's 5M default would pay the latency term thousands of times per step)
TABLE_BUCKET = 25_000_000


def scale_rows(cluster: Cluster, sequences: int = 4) -> list[dict[str, Any]]:
    """Per model × GPU count × stage: memory per GPU, step time, and whether it fits."""
    rows = []
    for model in MODELS.values():
        job = Job(model, sequences=sequences, bucket=TABLE_BUCKET)
        for n in (8, 64, 1024):
            for stage in range(4):
                memory = sum(memory_per_gpu(job, stage, n).values())
                time = step_time(job, stage, n, cluster)
                rows.append({"model": model.name, "gpus": n, "stage": stage, "memory_gb": memory / GB,
                             "fits": memory <= cluster.device.memory, "step_s": time["total"],
                             "exposed_s": time["exposed_comm"]})
    return rows


def scale_markdown(cluster: Cluster, sequences: int = 4) -> str:
    rows = scale_rows(cluster, sequences)
    lines = [f"{cluster.name}; {sequences} sequences of 2,048 tokens per GPU per step; bf16 with fp32 master "
             "weights and Adam; activation checkpointing; fp32 gradient reduction in 100 MB buckets.", "",
             "| model | GPUs | GB per GPU, stages 0 / 1 / 2 / 3 | step s, stages 0 / 1 / 2 / 3 | fits in 80 GB | fastest that fits |",
             "|---|---|---|---|---|---|"]
    for model in MODELS:
        for n in (8, 64, 1024):
            mine = [r for r in rows if r["model"] == model and r["gpus"] == n]
            fitting = [r for r in mine if r["fits"]]
            best = _fastest(fitting) if fitting else "none"
            memory = " / ".join(f"{r['memory_gb']:.1f}" for r in mine)
            times = " / ".join(f"{r['step_s']:.3f}" for r in mine)
            fits = ", ".join(str(r["stage"]) for r in fitting) or "none"
            lines.append(f"| {model} | {n:,} | {memory} | {times} | {fits} | {best} |")
    return "\n".join(lines) + "\n"


def _fastest(fitting: list[dict[str, Any]]) -> str:
    """The stages within 1% of the fastest (a model this coarse cannot order them more finely)."""
    quickest = min(r["step_s"] for r in fitting)
    return ", ".join(str(r["stage"]) for r in fitting if r["step_s"] <= quickest * 1.01)


def zero_paper_markdown() -> str:
    """The ZeRO paper's Figure 1 (7.5B parameters, K = 12, N_d = 64) against :func:`model_states`."""
    paper = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.88}
    lines = ["| stage | ZeRO paper, GB per device | this model, GB per device |", "|---|---|---|"]
    for stage, gb in paper.items():
        lines.append(f"| {stage} | {gb} | {model_states(7.5e9, stage, 64) / GB:.2f} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- this machine
def here_cluster(calibration: dict[str, Any], size: str = "", n: int = 1, stage: int = 0) -> Cluster:
    """This machine as measured by ``benchmarks.calibrate``: collectives through shared memory (what the
    engine uses on one host; gloo on loopback where the calibration has no such figures) take the cores.
    The compute rate and the optimizer's bandwidth are the ones measured for the GPT ``size`` where the
    calibration has them (small matrices run slower than large ones on a CPU; AdamW's passes over small
    tensors stay in cache), for ``n`` > 1 ranks with both ranks running at once (they share the caches and
    the memory bus); the host work per tensor and per gradient byte is the one measured at ``stage``, plus
    what 2 ranks add to it for ``n`` > 1."""
    measured = calibration.get("by_size_2_ranks" if n > 1 else "by_size", {}).get(size, {})
    flops = measured.get("flops", calibration["flops"])
    bandwidth = measured.get("bandwidth", calibration["bandwidth"])

    def measured_at_stage(key: str) -> float:
        return calibration.get(key, {}).get(str(stage), 0.0)

    host, per_byte = measured_at_stage("host_per_tensor_by_stage"), measured_at_stage("host_per_byte_by_stage")
    per_unit = 0.0
    if n > 1:
        host += measured_at_stage("host_per_tensor_by_stage_2_ranks")
        per_byte += measured_at_stage("host_per_byte_by_stage_2_ranks")
        per_unit = calibration.get("host_per_unit_2_ranks", 0.0)
    cpu = Device("this CPU (1 thread per rank)", flops, 24 * GB, bandwidth, "measured by benchmarks.calibrate",
                 host, per_byte, per_unit)
    source = "measured by benchmarks.calibrate"
    if "shm_alpha" not in calibration:
        link = Link("gloo on loopback", calibration["alpha"], calibration["beta"], source)
        return Cluster("this machine", cpu, 2, link, link, overlaps=False)
    link = Link("shared memory", calibration["shm_alpha"], calibration["shm_beta"], source)
    staged = Link("shared memory, staged", calibration["shm_gather_alpha"], calibration["shm_gather_beta"], source)
    return Cluster("this machine", cpu, 2, link, link, overlaps=False, staged=staged)


def gpt_preset(size: str, **overrides: int) -> Transformer:
    """An ``examples/gpt.py`` preset (with ``overrides`` of its config) as a :class:`Transformer`, counted
    exactly."""
    from .workload import gpt_module, model_numel, model_tensors, model_units

    cfg = gpt_module().gpt_config(size, **overrides)
    return Transformer(size, cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.block_size, cfg.vocab_size,
                       params=model_numel(size, **overrides), parameter_tensors=model_tensors(size, **overrides),
                       gathered_units=model_units(size, **overrides))


def predict_here(size: str, n: int, stage: int, calibration: dict[str, Any], sequences: int = 1) -> float:
    """Predicted fp32 step seconds of the benchmark's GPT ``size`` at ``stage`` on ``n`` gloo ranks here."""
    job = Job(gpt_preset(size), sequences=sequences, param_bytes=4, grad_bytes=4, state_bytes=8,
              checkpointing=False, all_reduce_for_scatter="shm_alpha" not in calibration)
    return step_time(job, stage, n, here_cluster(calibration, size, n, stage))["total"]


def validate(measured: dict[str, Any], calibration: dict[str, Any]) -> list[dict[str, Any]]:
    """Predicted vs measured step times for every row of a ``benchmarks.run --scaling-only`` JSON."""
    rows = []
    sequences = measured.get("micro_batch", 1)
    for row in measured["rows"]:
        predicted = predict_here(row["size"], row["world_size"], row["stage"], calibration, sequences)
        rows.append({**row, "predicted_s": predicted, "error": predicted / row["measured_s"] - 1})
    return rows


def _load_calibration(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", action="store_true", help="the scale table for each cluster preset")
    parser.add_argument("--zero-paper", action="store_true", help="the ZeRO paper's memory figures, reproduced")
    parser.add_argument("--validate", type=Path, nargs="+", metavar="SCALING_JSON",
                        help="compare with `benchmarks.run --scaling-only` results (scaling.json; several: the "
                             "median of each cell, as one sweep on a shared machine can catch a burst of load)")
    parser.add_argument("--calibration", type=Path, default=HERE, help="this machine's measured α, β, FLOP/s")
    parser.add_argument("--sequences", type=int, default=4, help="sequences per GPU per step in the table")
    args = parser.parse_args(argv)
    if args.zero_paper:
        print(zero_paper_markdown())
    if args.table:
        for cluster in CLUSTERS.values():
            print(scale_markdown(cluster, args.sequences))
    if args.validate:
        rows = validate(_measured_from_scaling(args.validate), _load_calibration(args.calibration))
        print(validation_markdown(rows))
        return 0 if all(abs(r["error"]) <= 0.15 for r in rows) else 1
    return 0


def _measured_from_scaling(paths: list[Path]) -> dict[str, Any]:
    """The rows of scaling.json files: size, world size, stage, median step seconds (the median over the
    files of each cell's median)."""
    cells: dict[tuple[str, int, int], list[float]] = {}
    micro_batch = 1
    for path in paths:
        data = json.loads(path.read_text())
        micro_batch = data.get("micro_batch", 1)
        for p in data["points"]:
            if "step_s" in p:
                cells.setdefault((p["size"], p["world_size"], p["stage"]), []).append(p["step_s"]["median"])
    rows = [{"size": size, "world_size": n, "stage": stage, "measured_s": statistics.median(times), "sweeps": len(times)}
            for (size, n, stage), times in cells.items()]
    return {"rows": rows, "micro_batch": micro_batch}


def validation_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| size | ranks | stage | measured ms | predicted ms | error |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['size']} | {r['world_size']} | {r['stage']} | {r['measured_s'] * 1e3:.1f} "
                     f"| {r['predicted_s'] * 1e3:.1f} | {r['error']:+.0%} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())

