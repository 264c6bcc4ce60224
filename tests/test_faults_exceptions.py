"""An exception caught mid-step: on every rank, training goes on as without that micro-batch; on one rank, every
rank raises.  Never a silent off-by-one between ranks.

Every stage, two ranks, `ParityNet` in fp32:

* a gradient hook raises `RuntimeError` or `KeyboardInterrupt` in `backward` on every rank (fc1's gradient:
  stage 3 has two reduce-scatters in flight by then), the script catches it, calls `engine.zero_grad()` and
  trains 3 more steps: the weights equal those of a run that skipped that micro-batch (1e-6; the same
  engine, so only float noise of the order of operations could differ, and there is none).  Right after the
  raise the backward is over (`backward.active` False) and nothing is in flight.  Before, stage 3 added the
  two in-flight reductions into the next step (0.037 off).
* the same for a forward pre-hook that raises (at stage 3, mid-gather; a `KeyboardInterrupt` there skips
  torch's always-called forward hooks, and used to leave the unit held for good);
* a script that does not call `zero_grad()` after such a backward is refused at its next `backward`, with
  the fix in the message; one whose `step` raised (the inner optimizer's step pre-hook) is refused at its
  next call, and goes on after `load_checkpoint`, to the weights of a run that skipped that step;
* the same raised on rank 1 only, in `backward`, `forward` or `step`: every rank raises within seconds, the
  survivor quoting rank 1's error.  Before, at stages 0 and 2, rank 0's step-3 gradients were averaged with
  rank 1's step-4 gradients and both went on.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from _faults_common import VICTIM, make_engine, record_row, train_step
from _parity import full_params_everywhere

from shardwise.faults import CommError
from shardwise.testing import run_distributed

STAGES = (0, 1, 2, 3)
#: fp32, the same engine with and without the failed micro-batch: nothing but the order of additions could differ
ATOL = 1e-6
#: "within seconds"
FAST = 4.0
FAILING_STEP = 3


class Armed:
    """Raises ``kind`` once ``now`` is set: in fc1's gradient hook (backward), fc2's forward pre-hook (forward)
    or the inner optimizer's step pre-hook (step)."""

    def __init__(self, engine: Any, where: str, kind: type[BaseException]) -> None:
        self.now = False
        self.kind = kind
        if where == "backward":
            engine.module.fc1.weight.register_hook(lambda grad: self.fire())
        elif where == "forward":
            engine.module.fc2.register_forward_pre_hook(lambda module, args: self.fire())
        else:
            engine.optimizer.inner.register_step_pre_hook(lambda optimizer, args, kwargs: self.fire())

    def fire(self) -> None:
        if self.now:
            self.now = False
            raise self.kind(f"injected in rank {dist.get_rank()}")


def _caught(action: Callable[[], Any]) -> dict[str, Any]:
    """How ``action`` ended (a ``KeyboardInterrupt`` too), and how long it took."""
    start = time.monotonic()
    try:
        action()
    except BaseException as exc:  # noqa: BLE001 - the test decides
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start,
                "comm": isinstance(exc, CommError)}
    return {"error": None, "seconds": time.monotonic() - start}


def _reference(stage: int, steps: list[int]) -> dict[str, torch.Tensor]:
    engine = make_engine(stage)
    for step in steps:
        train_step(engine, step)
    params = full_params_everywhere(engine)
    engine.destroy()
    return params


def _in_flight(engine: Any) -> int:
    strategy = engine.strategy
    works = strategy._works if strategy.stage == 3 else strategy.grads._works
    return len(works)


# ------------------------------------------------------------------ on every rank
def _every_rank(stage: int, where: str, kind: type[BaseException]) -> dict[str, Any]:
    engine = make_engine(stage)
    armed = Armed(engine, where, kind)
    for step in range(FAILING_STEP):
        train_step(engine, step)
    armed.now = True
    result = _caught(lambda: train_step(engine, FAILING_STEP))
    result["active"] = engine.strategy.backward.active
    result["in flight"] = _in_flight(engine)
    engine.zero_grad()  # the script's recovery
    result["after"] = _caught(lambda: [train_step(engine, step) for step in range(FAILING_STEP + 1, FAILING_STEP + 4)])
    got = full_params_everywhere(engine)
    engine.destroy()
    want = _reference(stage, [s for s in range(FAILING_STEP + 4) if s != FAILING_STEP])
    result["max diff"] = max((got[n] - want[n]).abs().max().item() for n in want)
    return result


def _without_zero_grad(stage: int) -> dict[str, Any]:
    engine = make_engine(stage)
    armed = Armed(engine, "backward", RuntimeError)
    train_step(engine, 0)
    armed.now = True
    first = _caught(lambda: train_step(engine, 1))
    refused = _caught(lambda: train_step(engine, 1))  # no `zero_grad()`: the partial gradients are still there
    engine.zero_grad()
    after = _caught(lambda: train_step(engine, 1))
    engine.destroy()
    return {"first": first, "refused": refused, "after": after}


def _failed_step(stage: int, root: str) -> dict[str, Any]:
    engine = make_engine(stage)
    armed = Armed(engine, "step", RuntimeError)
    for step in range(FAILING_STEP):
        train_step(engine, step)
    engine.save_checkpoint(root, tag="before")
    armed.now = True
    result = {"step": _caught(lambda: train_step(engine, FAILING_STEP))}
    engine.zero_grad()  # not enough: the weights may be partly updated
    result["refused"] = _caught(lambda: train_step(engine, FAILING_STEP + 1))
    engine.load_checkpoint(root, tag="before")
    result["after"] = _caught(lambda: [train_step(engine, step) for step in range(FAILING_STEP + 1, FAILING_STEP + 4)])
    got = full_params_everywhere(engine)
    engine.destroy()
    want = _reference(stage, [s for s in range(FAILING_STEP + 4) if s != FAILING_STEP])
    result["max diff"] = max((got[n] - want[n]).abs().max().item() for n in want)
    return result


EVERY_RANK = [("backward", RuntimeError), ("backward", KeyboardInterrupt), ("forward", RuntimeError),
              ("forward", KeyboardInterrupt)]


def _stage_cases(stage: int, root: str) -> dict[str, Any]:
    results: dict[str, Any] = {f"{where} {kind.__name__}": _every_rank(stage, where, kind)
                               for where, kind in EVERY_RANK}
    results["without zero_grad"] = _without_zero_grad(stage)
    results["failed step"] = _failed_step(stage, root)
    return results


@pytest.mark.parametrize("stage", STAGES)
def test_an_exception_caught_on_every_rank(stage: int, tmp_path: Path) -> None:
    results = run_distributed(_stage_cases, 2, args=(stage, str(tmp_path / "ckpt")), timeout=240)
    for rank, cases in enumerate(results):
        for where, kind in EVERY_RANK:
            case = cases[f"{where} {kind.__name__}"]
            assert case["error"] == kind.__name__, (rank, where, case)
            assert not case["active"] and case["in flight"] == 0, f"rank {rank}: the backward left state: {case}"
            assert case["after"]["error"] is None, (rank, where, case["after"])
            assert case["max diff"] <= ATOL, (
                f"rank {rank}, stage {stage}: {kind.__name__} in {where}, caught, then `zero_grad()` and 3 steps: "
                f"{case['max diff']:.3g} off a run without that micro-batch")
        refused = cases["without zero_grad"]["refused"]
        assert refused["error"] == "RuntimeError" and "call `engine.zero_grad()` on every rank" in refused["message"], \
            refused
        assert cases["without zero_grad"]["after"]["error"] is None, cases["without zero_grad"]
        failed = cases["failed step"]
        assert failed["step"]["error"] == "RuntimeError", failed
        assert "`engine.load_checkpoint(...)`" in failed["refused"].get("message", ""), failed["refused"]
        assert failed["after"]["error"] is None and failed["max diff"] <= ATOL, failed
    if stage == 3 or stage == 0:
        for where, kind in EVERY_RANK:
            worst = max(cases[f"{where} {kind.__name__}"]["max diff"] for cases in results)
            hook = "a gradient hook" if where == "backward" else "a forward pre-hook"
            after = ("reductions in flight are waited for and dropped; without `zero_grad()` the next `backward` is "
                     "refused, saying so" if where == "backward" else "what the module hooks held is let go")
            record_row("misuse", f"`{kind.__name__}` raised in `{where}` on every rank ({hook}), caught; "
                       "`zero_grad()`, then 3 more steps", str(stage),
                       f"the weights of a run without that micro-batch (max diff {worst:.1g}; {after})", None)
        record_row("misuse", "the inner optimizer's step raises on every rank, caught", str(stage),
                   "the next call is refused until `load_checkpoint` restores the weights; then training goes on "
                   "to the weights of a run without that step", None)


# ------------------------------------------------------------------ on one rank
def _one_rank(stage: int, where: str) -> dict[str, Any]:
    engine = make_engine(stage)
    armed = Armed(engine, where, RuntimeError)
    for step in range(FAILING_STEP):
        train_step(engine, step)
    armed.now = dist.get_rank() == VICTIM
    result = _caught(lambda: train_step(engine, FAILING_STEP))
    engine.zero_grad()  # the script's recovery, on both ranks: it cannot make them agree again
    result["after"] = _caught(lambda: [train_step(engine, step) for step in range(FAILING_STEP + 1, FAILING_STEP + 4)])
    return result


@pytest.mark.parametrize("where", ["backward", "forward", "step"])
@pytest.mark.parametrize("stage", (0, 2, 3))
def test_an_exception_on_one_rank_makes_every_rank_raise(stage: int, where: str) -> None:
    survivor, raiser = run_distributed(_one_rank, 2, args=(stage, where), timeout=120)
    assert raiser["error"] == "RuntimeError" and "injected in rank 1" in raiser["message"], raiser
    # the survivor raises in the step of the failure (it waits on a collective rank 1 never issued) or, when
    # rank 1 issued all of them, at its next collective call; never does a rank train on
    first = survivor if survivor["error"] is not None else survivor["after"]
    assert first["error"] is not None and first["comm"], f"rank 0 trained on: {survivor}"
    assert "injected in rank 1" in first["message"], first
    assert first["seconds"] < FAST, first
    for rank, result in enumerate((survivor, raiser)):
        after = result["after"]
        # a `CommError`, or (rank 1 after its own failed step) the refusal that asks for `load_checkpoint`
        assert after["error"] is not None, f"rank {rank} trained on after the failure: {result}"
        assert after["seconds"] < FAST, (rank, after)
    record_row("disagree", f"rank 1 alone raises in `{where}` (caught; `zero_grad()`, then it trains on)",
               str(stage), "every rank raises: rank 0 a `CommError` quoting rank 1's error, in that step or at its "
               "next call; rank 1 at its next collective call; no rank trains on", first["seconds"])
