"""ZeRO theory: per-rank state bytes and per-rank collective bytes for Ψ parameters on N ranks.

State (ZeRO paper, Adam): fp32 training holds 4Ψ parameters, 4Ψ gradients and
8Ψ optimizer state (m, v); mixed precision holds 2Ψ bf16 parameters, 2Ψ bf16
gradients and 12Ψ optimizer state (fp32 master, m, v).  Stage 1 divides the
optimizer state by N, stage 2 the gradients too, stage 3 the parameters too.

Traffic (ring accounting, as ``shardwise.comm.distributed.Comm`` counts it): with
f = (N-1)/N, an all-reduce of S bytes sends 2fS per rank, a reduce-scatter or
all-gather of a full-size S bytes sends fS, a broadcast sends S from its source.
Gradients are reduced in fp32 by every system here (4 bytes per element);
parameters are gathered in the compute dtype.
"""

from __future__ import annotations

from .configs import System

__all__ = ["comm_bytes", "state_bytes"]

_PARAM_BYTES = {"fp32": 4, "bf16": 2}
_REDUCE_BYTES = 4


def state_bytes(stage: int, dtype: str, numel: int, world_size: int) -> dict[str, float]:
    """ZeRO-paper per-rank bytes by kind (parameters, gradients, optimizer_state) at ``stage``."""
    low = dtype != "fp32"
    params = numel * _PARAM_BYTES[dtype]
    grads = numel * _PARAM_BYTES[dtype]
    optim = numel * (12 if low else 8)
    n = world_size
    return {
        "parameters": params / n if stage >= 3 else params,
        "gradients": grads / n if stage >= 2 else grads,
        "optimizer_state": optim / n if stage >= 1 else optim,
    }


def comm_bytes(system: System, numel: int, world_size: int, transport: str = "gloo") -> float:
    """Bytes one rank sends through collectives in one optimizer step of ``system``.

    ``transport``: how shardwise's collectives travel (``Comm.shm.name``).  Over gloo's sockets
    shardwise stages 1-2 average gradients with an all-reduce (faster there than its reduce-scatter:
    ``zero_optimization.reduce_scatter`` unset), which sends twice the reduction bytes; through shared
    memory and on NCCL, with a reduce-scatter.
    """
    if world_size == 1:
        return 0.0
    f = (world_size - 1) / world_size
    reduce = f * numel * _REDUCE_BYTES
    gather = f * numel * _PARAM_BYTES[system.dtype]
    if system.family == "shardwise" and system.stage in (1, 2) and transport == "gloo":
        return 2 * reduce + gather
    if system.family in ("shardwise", "deepspeed", "fsdp2"):
        if system.stage == 0:
            return 2 * reduce
        gathers = 2 if system.stage == 3 else 1
        return reduce + gathers * gather
    if system.family == "zero1":
        # DDP all-reduce, then every rank broadcasts its updated fp32 partition.
        return 2 * reduce + numel / world_size * 4
    return 2 * reduce  # ddp
