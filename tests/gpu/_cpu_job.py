"""A CPU-only job that continues a checkpoint: ``python _cpu_job.py LOAD SAVE OUT STAGE DTYPE``.

Run by test_gpu_checkpoint.py with ``CUDA_VISIBLE_DEVICES=""``, as on a
machine without a GPU: it loads LOAD (written by a GPU job), records the
masters it loaded, trains steps 2-3, saves to SAVE and writes what it saw to OUT.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _gpu  # noqa: E402

if __name__ == "__main__":
    load, save, out, stage, dtype = sys.argv[1:6]
    where = _gpu.one_rank("cpu")
    engine = _gpu.engine(int(stage), dtype, seed=1)  # other initial weights: the load must replace them
    path, _ = engine.load_checkpoint(load)
    loaded = _gpu.masters(engine)
    losses = _gpu.train(engine, 2, 2, where)
    engine.save_checkpoint(save, tag="cpu")
    torch.save({"path": path, "cuda": torch.cuda.is_available(), "loaded": loaded, "trained": _gpu.masters(engine),
                "losses": losses}, out)
    engine.destroy()
    dist.destroy_process_group()
