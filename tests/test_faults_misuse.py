"""Bad API input: each case is a named error, or it works and matches torch DDP.

Errors are engine-level (the same at every stage) and checked in one process at
stages 0 and 3. What distribution could break (shared, zero-size and
non-contiguous parameters, batches of different sizes per rank, models with no
parameters) runs on two ranks at stages 0-3 against DDP (1e-5; a plain DDP run is
~1e-7 from one process in fp32).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _faults_common import record_row
from _parity import adamw, batch, make_model, params_of
from torch import nn

import shardwise
from shardwise.testing import distributed_test, run_subtests

STAGES = (0, 1, 2, 3)
ATOL = 1e-5


def _config(stage: int, **extra: Any) -> dict[str, Any]:
    return {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, **extra}


def _engine(stage: int, model: nn.Module | None = None, **extra: Any) -> Any:
    model = model if model is not None else make_model(0)
    return shardwise.initialize(model, adamw(model.parameters()), _config(stage, **extra))


# ------------------------------------------------------------- named errors (one process)
def _loss(engine: Any, step: int = 0) -> torch.Tensor:
    return engine(*batch(step, 0))


ERRORS: dict[str, tuple[Callable[[int], Any], type[BaseException], str]] = {
    "a loss that is not a scalar": (
        lambda stage: (e := _engine(stage)).backward(e(batch(0, 0)[0]) * 1.0),
        ValueError, r"needs a scalar loss, got shape \(4, 8\); reduce it first"),
    "a loss that is a Python float": (
        lambda stage: (e := _engine(stage)).backward(_loss(e).item()),
        TypeError, r"needs the loss as a tensor, got `float`"),
    "a loss computed without grad": (
        lambda stage: (e := _engine(stage)).backward(_loss(e).detach()),
        ValueError, r"does not require grad"),
    "every parameter frozen": (
        lambda stage: (e := _engine(stage, make_model(0).requires_grad_(False))).backward(_loss(e)),
        ValueError, r"from no trainable parameter \(all frozen\?\)"),
    "`backward` twice without `step` at a boundary": (
        lambda stage: [(e := _engine(stage)).backward(_loss(e)), e.backward(_loss(e, 1))],
        RuntimeError, r"called again at an accumulation boundary without `engine.step\(\)`"),
    "`step` before any `backward`": (
        lambda stage: _engine(stage).step(),
        RuntimeError, r"`engine.step\(\)` was called with no `engine.backward\(loss\)` since the last step"),
    "a model with no parameters and an optimizer": (
        lambda stage: shardwise.initialize(nn.ReLU(), config={"optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                                              **_config(stage)}),
        ValueError, r"the model `ReLU` has no parameters and no buffers, so an optimizer has nothing to update"),
    "a model with only buffers and an optimizer": (
        lambda stage: shardwise.initialize(_BuffersOnly(), config={"optimizer": {"type": "SGD",
                                                                                  "params": {"lr": 0.1}},
                                                                    **_config(stage)}),
        ValueError, r"has only buffers, so an optimizer has nothing to update"),
    "a sparse parameter": (
        lambda stage: _engine(stage, _Sparse()),
        ValueError, r"parameter `w` has layout `torch.sparse_coo`; shardwise shards dense parameters only"),
    "something that is not a module": (
        lambda stage: shardwise.initialize(lambda x: x, config=_config(stage)),  # type: ignore[arg-type]
        TypeError, r"needs a `torch.nn.Module`, got `function`"),
}


class _BuffersOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.arange(4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class _Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.eye(3).to_sparse())


def _named_error(case: str, stage: int) -> None:
    action, error, pattern = ERRORS[case]
    with pytest.raises(error, match=pattern):
        action(stage)


def _backward_again_is_fine_after_zero_grad_or_under_no_sync() -> None:
    engine = _engine(0)
    engine.backward(_loss(engine))
    engine.zero_grad()  # the reduced gradients are gone: a new backward may reduce again
    engine.backward(_loss(engine, 1))
    assert engine.step()
    with engine.no_sync():
        engine.backward(_loss(engine, 2))
    engine.backward(_loss(engine, 3))
    assert engine.step()


@distributed_test(world_size=1, timeout=120)  # one rank: the checks are local; no process group in pytest's process
def test_bad_input_is_a_named_error() -> None:
    run_subtests(_named_error, [{"case": c, "stage": s} for c in ERRORS for s in (0, 3)])
    _backward_again_is_fine_after_zero_grad_or_under_no_sync()
    for case, (_, error, _) in ERRORS.items():
        record_row("misuse", case, "all", f"`{error.__name__}` naming the value and the fix, on the calling rank", None)


# ------------------------------------------------------- correct behaviour (two ranks)
class Tied(nn.Module):
    """One weight used by two modules (an embedding and the output head), as language models tie them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.mid(self.embed(idx).mean(dim=1))))
        return F.mse_loss(logits[:, :8], target)


class Odd(nn.Module):
    """Zero-size parameters next to non-contiguous ones (a transposed weight, a strided slice)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.empty = nn.Parameter(torch.empty(0))
        self.empty_rows = nn.Parameter(torch.empty(0, 16))
        self.w_t = nn.Parameter(torch.randn(8, 16).t())  # (16, 8), strides (1, 16)
        self.bias = nn.Parameter(torch.randn(8, 3)[:, 1])  # stride 3

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx).mean(dim=1) + self.empty_rows.sum(dim=0) + self.empty.sum()
        return F.mse_loss(h @ self.w_t + self.bias, target)


def _reference(make: Callable[[], nn.Module], sizes: list[int], steps: int) -> dict[str, torch.Tensor]:
    model = make()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = adamw(model.parameters())
    for step in range(steps):
        ddp(*batch(step, dist.get_rank(), size=sizes[dist.get_rank()])).backward()
        opt.step()
        opt.zero_grad()
    return params_of(model)


def _parity(stage: int, model: str, sizes: list[int]) -> None:
    make = {"tied": lambda: (torch.manual_seed(0), Tied())[1], "odd": lambda: (torch.manual_seed(0), Odd())[1],
            "parity": lambda: make_model(0)}[model]
    engine = _engine(stage, make())
    for step in range(3):
        engine.backward(engine(*batch(step, dist.get_rank(), size=sizes[dist.get_rank()])))
        engine.step()
    got = engine.full_state_dict()
    engine.destroy()  # collective: before any rank-0-only assertion can fail
    want = _reference(make, sizes, 3)
    if dist.get_rank() == 0:
        assert set(want) <= set(got), (sorted(got), sorted(want))  # a tied weight: once in `want`, twice in `got`
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, atol=ATOL, rtol=0.0, msg=lambda m, n=name: f"{n}: {m}")


def _no_parameters(stage: int) -> None:
    for module in (nn.ReLU(), _BuffersOnly()):
        engine = shardwise.initialize(module, config=_config(stage))
        x = torch.randn(2, 4)
        torch.testing.assert_close(engine(x), module(x))
        engine.destroy()


@distributed_test(world_size=2, timeout=240)
def test_shapes_and_layouts_that_work_match_ddp() -> None:
    cases = [{"stage": s, "model": m, "sizes": [4, 4]} for s in STAGES for m in ("tied", "odd")]
    cases += [{"stage": s, "model": "parity", "sizes": [3, 6]} for s in STAGES]
    run_subtests(_parity, cases)
    run_subtests(_no_parameters, [{"stage": s} for s in (0, 3)])
    if dist.get_rank() == 0:
        for fault, result in (
                ("parameters shared between two modules (a tied embedding and head)", "trains as DDP (1e-5)"),
                ("zero-size and non-contiguous parameters", "trains as DDP (1e-5)"),
                ("a batch of a different size on each rank (3 and 6 samples)",
                 "trains as DDP (1e-5): each rank's mean loss, averaged over ranks"),
                ("a model with no parameters, or only buffers, and no optimizer",
                 "an inference-only engine: its forward equals the module's")):
            record_row("misuse", fault, "0-3", result, None)


def test_keys_the_stage_does_not_use_say_so() -> None:
    """Implemented keys that the chosen stage ignores get an info line (nothing accepted silently)."""
    cases = {
        3: ({"reduce_bucket_size": 1000, "reduce_scatter": False}, "stage 3 reduce-scatters"),
        2: ({"stage3_prefetch_bucket_size": 10, "stage3_param_persistence_threshold": 0}, "it tunes stage 3"),
        0: ({"reduce_scatter": False}, "stage 0 all-reduces"),
    }
    for stage, (keys, why) in cases.items():
        notes = [str(n) for n in shardwise.Config.load({"zero_optimization": {"stage": stage, **keys}})
                 .resolve(world_size=2).notes]
        for key in keys:
            assert any(f"`zero_optimization.{key}` changes nothing here: {why}" in n for n in notes), (stage, notes)
    quiet = shardwise.Config.load({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 10}})
    assert not [n for n in quiet.resolve(world_size=2).notes if "changes nothing" in str(n)]
    record_row("misuse", "a key the stage does not use (`reduce_bucket_size` at stage 3, `stage3_*` at 0-2)",
               "all", "accepted with an info line at `initialize` saying why it changes nothing", None)
