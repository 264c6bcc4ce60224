"""A collective called on one rank only, or a rank that raised and went elsewhere: every rank raises, at once.

The issue's table, two ranks at ZeRO-3, on a model whose two layers of one shape run in the other order than
they were registered (so a gather of one paired with a gather of the other gives wrong values, not an error):

* rank 0 alone calls `full_state_dict`, `save_16bit_model`, `GatheredParameters`, `save_pretrained`,
  `destroy` or (Hugging Face GPT-2) `generate` while rank 1 trains on; or `full_state_dict` while rank 1
  calls `destroy`.  Before, each returned wrong weights or tokens, wrote files from them, or hung; now every
  collective operation announces itself first, and both ranks raise `CollectiveMismatchError` within
  seconds naming what each was in, before any data moved and before anything was written.  Nothing was
  exchanged, so the ranks then train on together (to torch DDP's weights, 1e-5).
* rank 1 raises in `backward` (a gradient hook) and then sleeps, saves or reads the state: rank 0, waiting
  in a collective rank 1 never issued, reads the error rank 1 published between slices of its wait and
  raises `PeerFailedError` quoting it within ~1 s, instead of at `comms.timeout`.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _faults_common import VICTIM, bounded_outcome, fault_config, make_engine, outcome, record_row, train_step
from _parity import adamw, assert_close_params, full_params_everywhere
from torch import nn

import shardwise
from shardwise.testing import run_distributed

#: a call that has not returned after this many seconds is reported as still waiting (a hang)
LIMIT = 12.0
#: "within seconds": what every rank's error must take at most
FAST = 4.0


class Reordered(nn.Module):
    """`a` and `b` have one shape and run as b, then a: registration order is a, b, so a rank gathering in
    registration order (a consolidation) and one gathering in forward order pair `a` with `b`."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.head(torch.tanh(self.a(torch.tanh(self.b(x))))), y)


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)


def _reordered_engine() -> Any:
    torch.manual_seed(0)
    model = Reordered()
    # no prefetch: each rank gathers exactly the modules it runs
    config = fault_config(3, zero_optimization={"stage3_prefetch_bucket_size": 0})
    return shardwise.initialize(model, adamw(model.parameters()), config)


def _train(engine: Any, step: int) -> None:
    engine.backward(engine(*_data(step, dist.get_rank())))
    engine.step()


def _ddp_reference(steps: list[int]) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Reordered()
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = adamw(model.parameters())
    for step in steps:
        ddp(*_data(step, dist.get_rank())).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------- one rank alone in a collective call
def _gathered(engine: Any) -> dict[str, torch.Tensor]:
    with shardwise.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


#: case -> (what rank 0 does, what rank 1 does, the operation each is named in, the file rank 0 would write)
CASES: dict[str, tuple[Callable[[Any, Path], Any], Callable[[Any, Path], Any], tuple[str, str], str]] = {
    "`full_state_dict()` while rank 1 trains on": (
        lambda e, d: e.full_state_dict(), lambda e, d: _train(e, 1), ("`full_state_dict`", "`forward`"), ""),
    "`save_16bit_model(dir)`, then both ranks train": (
        lambda e, d: e.save_16bit_model(str(d)), lambda e, d: _train(e, 1), ("`save_16bit_model`", "`forward`"),
        "pytorch_model.bin"),
    "`GatheredParameters(...)`, read-only, while rank 1 trains on": (
        lambda e, d: _gathered(e), lambda e, d: _train(e, 1), ("`GatheredParameters`", "`forward`"), ""),
    "`save_pretrained(dir)` while rank 1 trains on": (
        lambda e, d: e.save_pretrained(str(d)), lambda e, d: _train(e, 1), ("`save_pretrained`", "`forward`"),
        "model.safetensors"),
    "`destroy()` while rank 1 trains on": (
        lambda e, d: e.destroy(), lambda e, d: _train(e, 1), ("`destroy`", "`forward`"), ""),
    "`full_state_dict()` while rank 1 calls `destroy()`": (
        lambda e, d: e.full_state_dict(), lambda e, d: e.destroy(), ("`full_state_dict`", "`destroy`"), ""),
}


def _alone(case: str, root: str) -> dict[str, Any]:
    engine = _reordered_engine()
    _train(engine, 0)
    mine, theirs, _, _ = CASES[case]
    action = mine if dist.get_rank() == 0 else theirs
    result = bounded_outcome(functools.partial(action, engine, Path(root)), LIMIT)
    if result["error"] == "still waiting":
        return result
    result["files"] = sorted(p.name for p in Path(root).glob("*")) if Path(root).exists() else []
    # nothing was exchanged: both ranks train on together, to the weights of a run without the call
    result["after"] = after = outcome(lambda: [_train(engine, step) for step in (1, 2)])
    if after["error"] is None:
        got = full_params_everywhere(engine)
        engine.destroy()
        assert_close_params(got, _ddp_reference([0, 1, 2]), atol=1e-5)
    return result


def _check_alone(results: list[dict[str, Any]], names: tuple[str, str], written: str) -> float:
    for rank, result in enumerate(results):
        assert result["error"] != "still waiting", f"rank {rank} still waited after {LIMIT:g} s: {results}"
        assert result["error"] == "CollectiveMismatchError", (
            f"rank {rank} did not raise (a collective called on one rank paired silently): {results}")
        message = result["message"]
        assert f"rank 0 is in {names[0]} of engine (stage 3, Reordered)" in message, message
        assert f"rank 1 is in {names[1]} of engine (stage 3, Reordered)" in message, message
        assert "not under `if rank == 0:`" in message and "Nothing was exchanged" in message, message
        assert result["seconds"] < FAST, result
        assert not written or written not in result["files"], f"rank {rank}: {written} was written: {result}"
        assert result["after"]["error"] is None, result["after"]
    return max(r["seconds"] for r in results)


@pytest.mark.parametrize("case", list(CASES))
def test_a_collective_on_rank_0_alone_raises_on_every_rank(case: str, tmp_path: Path) -> None:
    _, _, names, written = CASES[case]
    results = run_distributed(_alone, 2, args=(case, str(tmp_path / "out")), timeout=90)
    seconds = _check_alone(results, names, written)
    nothing = "; nothing written" if written else ""
    record_row("disagree", f"rank 0 alone calls {case} (a model whose two same-shape layers run in another "
               "order than registered)", "3",
               f"every rank raises `CollectiveMismatchError` before any data moves, naming {names[0]} on rank 0 and "
               f"{names[1]} on rank 1{nothing}; the ranks then train on together (DDP's weights, 1e-5)", seconds)


# ---------------------------------------------------------------- Hugging Face generate on one rank
VOCAB = 64


def _gpt2() -> nn.Module:
    import transformers  # in the `test` extras: a missing install fails here, it does not skip

    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _gpt2_train(engine: Any, step: int) -> None:
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()


def _generate_alone() -> dict[str, Any]:
    model = _gpt2()
    engine = shardwise.initialize(model, adamw(model.parameters()), fault_config(3))
    _gpt2_train(engine, 0)
    prompt = torch.tensor([[1, 2, 3, 4]])
    if dist.get_rank() == 0:
        action: Callable[[], Any] = lambda: engine.generate(prompt, max_new_tokens=2, do_sample=False,  # noqa: E731
                                                            pad_token_id=0)
    else:
        action = functools.partial(_gpt2_train, engine, 1)
    result = bounded_outcome(action, LIMIT)
    if result["error"] != "still waiting":
        result["after"] = outcome(lambda: [_gpt2_train(engine, step) for step in (1, 2)])
    return result


def test_generate_on_rank_0_alone_raises_on_every_rank() -> None:
    results = run_distributed(_generate_alone, 2, timeout=120)
    for rank, result in enumerate(results):
        assert result["error"] == "CollectiveMismatchError", f"rank {rank}: {results}"
        message = result["message"]
        assert "rank 0 is in a stage-3 forward without grad of engine (stage 3, GPT2LMHeadModel), in `generate`," in message, message
        assert "rank 1 is in `forward` of engine (stage 3, GPT2LMHeadModel)" in message, message
        assert result["seconds"] < FAST, result
        assert result["after"]["error"] is None, result["after"]
    record_row("disagree", "rank 0 alone calls `generate(max_new_tokens=2)` (Hugging Face GPT-2) while rank 1 "
               "trains on", "3", "every rank raises `CollectiveMismatchError` at rank 0's first pass, naming "
               "`generate` on rank 0 and `forward` on rank 1; the ranks then train on together",
               max(r["seconds"] for r in results))


# ---------------------------------------------------------------- a rank that raised and went elsewhere
#: long enough that a survivor waiting it out fails the test by far
PATIENT = 30.0


def _raise_then(stage: int, then: str, shared: bool, root: str) -> dict[str, Any]:
    engine = make_engine(stage, comms={"timeout": PATIENT, "shared_memory": shared},
                         checkpoint={"timeout": PATIENT})
    train_step(engine, 0)
    if dist.get_rank() == VICTIM:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("a gradient hook failed on rank 1")

        engine.module.fc1.weight.register_hook(hook)  # fc1's gradient comes last: rank 0 reduces meanwhile
    result = outcome(lambda: train_step(engine, 1))
    if dist.get_rank() == VICTIM:
        elsewhere: dict[str, Callable[[], Any]] = {
            "sleeps": lambda: time.sleep(8.0), "saves": lambda: engine.save_checkpoint(root, tag="after"),
            "reads the state": engine.full_state_dict}
        result["then"] = outcome(elsewhere[then])
    result["written"] = (Path(root) / "after").exists()
    return result


RAISE_THEN = [(2, "sleeps", True), (3, "sleeps", True), (3, "sleeps", False), (2, "saves", True),
              (3, "saves", True), (3, "reads the state", True)]


@pytest.mark.parametrize(("stage", "then", "shared"), RAISE_THEN)
def test_a_rank_that_raised_and_went_elsewhere_is_named_at_once(stage: int, then: str, shared: bool,
                                                                tmp_path: Path) -> None:
    survivor, raiser = run_distributed(_raise_then, 2, args=(stage, then, shared, str(tmp_path / "ckpt")),
                                       timeout=120)
    assert raiser["error"] == "RuntimeError" and "a gradient hook failed" in raiser["message"], raiser
    assert survivor["error"] == "PeerFailedError" and "a gradient hook failed on rank 1" in survivor["message"], \
        survivor
    assert survivor["seconds"] < FAST, f"rank 0 waited {survivor['seconds']:.1f} s for rank 1: {survivor}"
    if then != "sleeps":
        # its next collective call meets rank 0's published error (or rank 0's exit): it raises too, naming
        # where rank 0 gave up, before anything is written
        assert raiser["then"]["error"] in ("PeerFailedError", "CommError", "CollectiveMismatchError", "RankGoneError"), \
            raiser["then"]
        assert raiser["then"]["seconds"] < FAST, raiser["then"]
        assert not raiser["written"], raiser
    how = "" if shared else " (`comms.shared_memory: false`)"
    record_row("disagree", f"rank 1 raises in `backward` (a gradient hook), catches it and {then}{how}", str(stage),
               "rank 0, waiting in a collective rank 1 never issued, raises `PeerFailedError` quoting rank 1's "
               "error (it reads what rank 1 published between slices of its wait, not at `comms.timeout`)"
               + ("; rank 1's next call raises too, nothing written" if then != "sleeps" else ""),
               survivor["seconds"])
