"""A short training job whose weights test_gpu_streams.py compares with and without ``CUDA_LAUNCH_BLOCKING=1``.

``python _stream_job.py OUT``: the Trainer feeds batches from a
``DataLoader(pin_memory=True)``, so its ``non_blocking`` copies to the GPU are
truly asynchronous, through two engines: stage 2 in bf16 with
``overlap_comm``, and stage 3 with the optimizer offloaded to pinned CPU
memory.  Kernels are made deterministic (deterministic algorithms, cuBLAS
workspace, the math attention kernel), so the only thing that could change
the result between the two runs is a missing wait on a copy or a stream.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: deterministic cuBLAS

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _gpu  # noqa: E402

import shardwise  # noqa: E402

JOBS: dict[str, tuple[int, str, dict[str, Any]]] = {
    "stage2-bf16-overlap": (2, "bf16", {"overlap_comm": True}),
    "stage3-offload-pinned": (3, "fp32", {"offload_optimizer": {"device": "cpu", "pin_memory": True}}),
}
STEPS = 8


def _loader() -> DataLoader:  # type: ignore[type-arg]
    x, y = zip(*(_gpu.batch(step, torch.device("cpu")) for step in range(STEPS)))
    return DataLoader(TensorDataset(torch.cat(x), torch.cat(y)), batch_size=_gpu.MICRO, pin_memory=True)


def run(stage: int, dtype: str, zero: dict[str, Any]) -> dict[str, torch.Tensor]:
    config = _gpu.config(stage, dtype)
    config["zero_optimization"].update(zero)
    model = _gpu.gpt(0)
    engine = shardwise.initialize(model, _gpu.adamw(model.parameters()), config)
    trainer = shardwise.Trainer(engine, _loader(), max_steps=STEPS, progress=False,
                                loss_fn=lambda output, batch: output[1])
    trainer.fit()
    weights = _gpu.masters(engine)
    engine.destroy()
    return weights


if __name__ == "__main__":
    torch.use_deterministic_algorithms(True, warn_only=True)  # an op without a deterministic kernel warns
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    _gpu.one_rank(sys.argv[2] if len(sys.argv) > 2 else "cuda")
    torch.save({name: run(*job) for name, job in JOBS.items()}, sys.argv[1])
    dist.destroy_process_group()
