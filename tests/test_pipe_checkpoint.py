"""Checkpoints of a pipeline: pipeline → ``to_sequential()`` at ZeRO-3 → pipeline, by name, on 2 ranks.

Each load is checked twice: the weights (and a buffer that lives on the last
stage) equal what was saved, and the next step of the loaded engine equals
the next step of the one that saved (within 1e-5), which only holds if the
optimizer state (AdamW moments and step count) came along too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _pipe_models import Shift, assert_close, micro_batches, pipeline, tied_layers

import shardwise
from shardwise.checkpoint import consolidated_state_dict
from shardwise.pipe import LayerSpec
from shardwise.testing import distributed_test

ATOL = 1e-5
LAYERS_AT = [0, 3, 8]  # stage 0: embedding, pool, Linear; stage 1: ..., Shift (the buffer), tied head


def _layers() -> list[Any]:
    layers = tied_layers(depth=2)
    layers.insert(6, LayerSpec(Shift))
    return layers


def _config(zero: int, accumulation: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": {"stage": zero},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
    }


def _everywhere(engine: Any) -> dict[str, torch.Tensor]:
    box = [engine.full_state_dict()]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _pipeline(zero: int, partition: list[int]) -> Any:
    return shardwise.initialize(pipeline(_layers(), num_stages=2, partition_method=partition), config=_config(zero, 2))


def _sequential_step(engine: Any, first: int) -> float:
    """One step on micro-batches ``first`` (rank 0) and ``first + 1`` (rank 1): the pipeline's batch."""
    (x, y), = micro_batches(first + dist.get_rank(), 1)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / 2


@distributed_test(world_size=2, timeout=300)
def test_pipeline_to_sequential_to_pipeline(tmp_path: Path) -> None:
    rank = dist.get_rank()
    pipe = _pipeline(1, LAYERS_AT)
    data = micro_batches(0, 4)
    for _ in range(2):
        pipe.train_batch(data)
    if pipe.module.is_last_stage:
        pipe.module.get_submodule("6").offset.fill_(0.25)
    saved = _everywhere(pipe)
    assert list(saved) == list(pipeline(_layers()).to_sequential().state_dict())  # the mapping is one to one
    pipe.save_checkpoint(str(tmp_path), tag="pipe", client_state={"epoch": 3})
    if rank == 0:  # a plain checkpoint: consolidation (one process, no group) gives the whole model
        assert_close(consolidated_state_dict(tmp_path, tag="pipe"), saved, 0.0)

    # pipeline -> sequential (ZeRO-3 over both ranks)
    seq = shardwise.initialize(pipeline(_layers()).to_sequential(), config=_config(3, 1))
    path, client = seq.load_checkpoint(str(tmp_path), tag="pipe")
    assert client == {"epoch": 3} and path.endswith("pipe") and seq.global_steps == 2
    loaded = _everywhere(seq)
    assert_close(loaded, saved, 0.0)
    assert loaded["6.offset"].eq(0.25).all()
    want = pipe.train_batch(micro_batches(4, 2)).item()
    torch.testing.assert_close(_sequential_step(seq, 4), want, rtol=0, atol=ATOL)
    assert_close(_everywhere(seq), _everywhere(pipe), ATOL)

    # sequential -> pipeline (another ZeRO stage and another partition: names are global)
    seq.save_checkpoint(str(tmp_path), tag="seq")
    back = _pipeline(0, [0, 5, 8])
    back.load_checkpoint(str(tmp_path), tag="seq")
    assert back.global_steps == 3
    assert_close(_everywhere(back), _everywhere(seq), 0.0)
    want = _sequential_step(seq, 6)
    torch.testing.assert_close(back.train_batch(micro_batches(6, 2)).item(), want, rtol=0, atol=ATOL)
    assert_close(_everywhere(back), _everywhere(seq), ATOL)

    # the 16-bit export: one file of the whole model, written once
    back.save_16bit_model(str(tmp_path), "model.pt")
    if rank == 0:
        exported = torch.load(tmp_path / "model.pt", weights_only=True)
        assert list(exported) == list(saved)
    for engine in (pipe, seq, back):
        engine.destroy()
