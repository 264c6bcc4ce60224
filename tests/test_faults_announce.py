"""Every collective API announces itself; a collective added later without an announcement fails here.

* Every public collective of the engine, the pipeline engine and the package (DESIGN.md's list) is in
  `shardwise.faults.announce.OPERATIONS`, the registry the announcing code fills.
* Every public method of `Engine` (and `PipelineEngine`) is either announced or listed here as local: a new
  public method fails this test until it is classified (and, if collective, announced).
* A tour of the whole API on two ranks at every stage with `SHARDWISE_STRICT_COLLECTIVES` on, where a
  collective issued outside any announced operation raises: training with accumulation, evaluation,
  `engine.module(x)` and `loss.backward()` bypassing the engine, `generate`, `GatheredParameters`,
  `zero.load_state_dict`-free weight access, every save and load (one engine and several), trainability
  changes and `destroy`.
* What one announcement costs (a 2-rank exchange on the control group), measured with its spread.
"""

from __future__ import annotations

import inspect
import statistics
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _faults_common import fault_config, make_engine, train_step
from _parity import adamw, batch, make_model

import shardwise
from shardwise.faults import announce
from shardwise.pipe.engine import PipelineEngine
from shardwise.testing import run_distributed

#: DESIGN.md's collective APIs (and the methods that move data on every rank), by the name they are registered
COLLECTIVES = {
    "Engine.__init__", "Engine.forward", "Engine.backward", "Engine.step", "Engine.destroy",
    "Engine.refresh_trainable", "Engine.generate", "WeightsSurface.save_checkpoint",
    "WeightsSurface.load_checkpoint", "WeightsSurface.full_state_dict", "WeightsSurface.save_16bit_model",
    "WeightsSurface.save_pretrained", "WeightsSurface.state_dict_16bit", "GatheredParameters.__enter__",
    "save_checkpoints", "load_checkpoints", "PipelineEngine.train_batch", "PipelineEngine.eval_batch",
    "PipelineEngine.full_state_dict", "PipelineEngine.save_16bit_model", "load_state_dict",
}

#: public methods and properties of the engine that issue no collective (read or set local state)
LOCAL = {
    # training-loop bookkeeping and settings
    "zero_grad", "no_sync", "is_gradient_accumulation_boundary", "get_lr", "set_lr", "loss_scale",
    "override_loss_scale", "train", "eval", "compile", "is_compiled", "label", "checkpointable",
    "memory_breakdown",
    # DeepSpeed's getters (engine/getters.py), and a plain engine's refusal of the pipeline's calls
    "local_rank", "global_rank", "world_size", "train_batch_size", "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps", "fp16_enabled", "bfloat16_enabled", "get_global_grad_norm", "gradient_clipping",
    "was_step_applied", "zero_optimization_stage", "train_batch", "eval_batch", "device", "dp_world_size",
    "global_samples", "steps_per_print", "training_dataloader",
    # the pipeline engine's data sources
    "set_dataloader", "set_dataiterator",
}


def _announced(cls: type, name: str) -> bool:
    attribute = inspect.getattr_static(cls, name)
    function = getattr(attribute, "__wrapped__", None)
    owner = next(c for c in cls.__mro__ if name in vars(c))
    return function is not None or f"{owner.__name__}.{name}" in announce.OPERATIONS


def test_every_public_collective_announces_itself() -> None:
    missing = sorted(COLLECTIVES - set(announce.OPERATIONS))
    assert not missing, f"collective APIs that do not announce themselves: {missing}"


@pytest.mark.parametrize("cls", [shardwise.Engine, PipelineEngine])
def test_every_public_method_is_announced_or_local(cls: type) -> None:
    public = {name for name in dir(cls) if not name.startswith("_")}
    # the pipeline's own calls are collective there, and it refuses the plain engine's loop
    local = LOCAL ^ ({"train_batch", "eval_batch", "forward", "backward", "step"} if cls is PipelineEngine else set())
    unclassified = sorted(name for name in public if name not in local and not _announced(cls, name))
    assert not unclassified, (
        f"public methods of `{cls.__name__}` neither announced nor known to be local: {unclassified}; a collective "
        "one must announce itself (`shardwise.faults.announce.collective`), a local one goes into LOCAL here")


# ------------------------------------------------------------------ the strict tour
def _tour(stage: int, root: str) -> list[str]:
    announce.STRICT = True  # a collective outside any announced operation raises
    rank = dist.get_rank()
    done = []
    engine = make_engine(stage, gradient_accumulation_steps=2)
    for step in range(4):  # a step of two micro-batches: the first backward accumulates, the second reduces
        train_step(engine, step)
    with torch.no_grad():
        engine(*batch(5, rank))
    engine.eval()
    engine.generate(batch(6, rank)[0][:, :4], 2)  # the model's own loop: one pass per token
    engine.module(*batch(7, rank))  # around the engine
    engine.train()
    done.append("training, evaluation, generate, a forward around the engine")
    if stage == 3:
        engine.module(*batch(8, rank)).backward()  # a backward around the engine too
        engine.zero_grad()
        done.append("a backward around the engine")
    with shardwise.zero.GatheredParameters(list(engine.module.parameters())):
        pass
    with shardwise.zero.GatheredParameters([engine.module.fc1.weight], modifier_rank=0):
        pass
    state = engine.full_state_dict()
    shardwise.zero.load_state_dict(engine.module, state if rank == 0 else {})  # rank 0 reads the source
    engine.save_16bit_model(root)
    engine.save_pretrained(f"{root}/hf")
    engine.save_checkpoint(root, tag="one")
    engine.load_checkpoint(root, tag="one")
    done.append("gathers, exports, a checkpoint saved and loaded")
    engine.module.fc1.requires_grad_(False)  # the next forward rebuilds the trainable set (a collective)
    for step in range(2):
        train_step(engine, 10 + step)
    engine.module.fc1.requires_grad_(True)
    engine.refresh_trainable()
    done.append("trainability changed")
    model = make_model(1)
    student = shardwise.initialize(model, adamw(model.parameters()), fault_config(stage), name="student")
    shardwise.save_checkpoints(f"{root}/many", {"main": engine, "student": student})
    shardwise.load_checkpoints(f"{root}/many", {"main": engine, "student": student})
    done.append("several engines saved and loaded")
    student.destroy()
    with pytest.raises(RuntimeError, match="outside any announced operation"):
        engine.comm.all_reduce(torch.ones(1))  # what this test would catch: a collective no operation announced
    engine.destroy()
    done.append("destroy")
    return done


@pytest.mark.parametrize("stage", (0, 1, 2, 3))
def test_no_collective_runs_outside_an_announced_operation(stage: int, tmp_path: Path) -> None:
    results = run_distributed(_tour, 2, args=(stage, str(tmp_path / "out")), timeout=240)
    assert results[0] == results[1] and results[0][-1] == "destroy", results


# ------------------------------------------------------------------ what one costs
ROUNDS = 2000


def _cost() -> dict[str, float]:
    engine = make_engine(3)
    announcer = engine._announcer
    for _ in range(200):  # warm-up
        announcer.announce("a measured operation")
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        announcer.announce("a measured operation")
        times.append(time.perf_counter() - start)
    engine.destroy()
    deciles = statistics.quantiles(times, n=10)
    return {"median_us": statistics.median(times) * 1e6, "p10_us": deciles[0] * 1e6, "p90_us": deciles[-1] * 1e6}


def test_one_announcement_costs_well_under_a_millisecond() -> None:
    """Two ranks, one exchange of 16 int64 on the gloo control group: what each forward, reducing backward and
    collective call adds (the step check costs the same, once a step, as before)."""
    costs = run_distributed(_cost, 2, timeout=120)
    median = max(c["median_us"] for c in costs)
    # a loaded 2-core machine (docs/faults.md has the figures: a median of 180-350 µs)
    assert median < 5000, costs
    print(f"one announcement, 2 ranks: median {median:.0f} µs, p10-p90 {min(c['p10_us'] for c in costs):.0f}-"
          f"{max(c['p90_us'] for c in costs):.0f} µs over {ROUNDS}")
