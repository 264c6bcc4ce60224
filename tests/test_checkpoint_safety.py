"""Checkpoints that go wrong: ranks that disagree, a rank killed mid-write, pickles, partial loads."""

from __future__ import annotations

import fractions
import os
import pickle
import signal
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _checkpoint_common import assert_same, build, full_params, snapshot, train
from _checkpoint_edits import rehash
from _parity import batch

from shardwise.checkpoint import CheckpointError, describe
from shardwise.faults import CollectiveMismatchError
from shardwise.testing import DistributedTestError, distributed_test, run_distributed, run_subtests

_TIMEOUT = 3.0  # seconds ranks wait for each other in these tests


def _quick(stage: int = 1, seed: int = 0, **checkpoint: Any) -> Any:
    return build(stage, seed=seed, checkpoint={"timeout": _TIMEOUT, **checkpoint})


def _step(engine: Any, step: int) -> None:
    idx, target = batch(step, dist.get_rank())
    engine.backward(engine(idx, target))
    engine.step()


# ------------------------------------------------------------ ranks disagree


def _mismatched_tags(root: str) -> None:
    Path(root).mkdir(parents=True, exist_ok=True)
    engine = _quick()
    with pytest.raises(CheckpointError, match="different tags"):
        engine.save_checkpoint(root, tag=f"tag{dist.get_rank()}")
    # one rank saving while the other loads: their announcements differ, before anything is read or written
    with pytest.raises(CollectiveMismatchError, match="rank 0 is in `save_checkpoint` of .* rank 1 is in "
                                                      "`load_checkpoint` of"):
        if dist.get_rank() == 0:
            engine.save_checkpoint(root, tag="x")
        else:
            engine.load_checkpoint(root, tag="x")
    assert not any(p.name.startswith(("tag", "x")) for p in Path(root).iterdir())
    engine.destroy()


@distributed_test(world_size=2, timeout=180)
def test_ranks_that_disagree_raise_instead_of_hanging(tmp_path: Path) -> None:
    # a rank that skips the save: tests/test_faults_checkpoint.py (bounded, so a regression fails fast)
    run_subtests(_mismatched_tags, [{"root": str(tmp_path / "tags")}])


# ------------------------------------------------------------ killed mid-write


def _save_then_die(root: str) -> Any:
    engine = _quick(stage=2)
    train(engine, 0, 2)
    engine.save_checkpoint(root, tag="good")
    saved = full_params(engine)
    if dist.get_rank() == 0:
        with open(Path(root) / "saved.pt", "wb") as handle:
            torch.save(saved, handle)
    train(engine, 2, 1)
    if dist.get_rank() == 1:
        import torch.distributed.checkpoint.filesystem as dcp_files

        def die(_transforms: Any, stream: Any, *args: Any, **kwargs: Any) -> Any:
            stream.write(b"half a tensor")
            stream.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        dcp_files._write_item = die
    engine.save_checkpoint(root, tag="bad")
    return "unreachable"


def _load_after_crash(root: str) -> None:
    engine = _quick(stage=3, seed=5)
    engine.load_checkpoint(root)  # `latest`
    want = torch.load(Path(root) / "saved.pt", weights_only=True)
    assert_same(full_params(engine), want, "loaded after the crash")
    temps = [p.name for p in Path(root).iterdir() if p.name.startswith(".tmp-bad-")]
    assert len(temps) == 1, temps
    with pytest.raises(CheckpointError) as caught:
        engine.load_checkpoint(root, tag=temps[0])
    message = str(caught.value)
    assert "incomplete" in message and ".metadata" in message and "__1_0.distcp" in message, message
    engine.destroy()


def test_rank_killed_while_writing_leaves_previous_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(DistributedTestError, match="rank 1 .*SIGKILL"):
        run_distributed(_save_then_die, 2, args=(str(tmp_path),), timeout=60)
    assert (tmp_path / "latest").read_text() == "good"
    assert not (tmp_path / "bad").exists()
    listing = describe(tmp_path)
    assert "good  (latest)" in listing and "INCOMPLETE" in listing, listing
    run_distributed(_load_after_crash, 2, args=(str(tmp_path),), timeout=120)


# ---------------------------------------------------- pickles and load options


def _pickles(root: str) -> None:
    odd = {"ratio": fractions.Fraction(1, 3)}
    plain = _quick()
    with pytest.raises(CheckpointError, match="allow_pickle"):
        plain.save_checkpoint(root, tag="refused", client_state=odd)
    dist.barrier()  # rank 0 removes the unfinished directory on its way out
    assert not [p for p in Path(root).iterdir() if "refused" in p.name], "a refused save must leave nothing"
    trusting = _quick(allow_pickle=True)
    trusting.save_checkpoint(root, tag="pickled", client_state=odd)
    with pytest.raises(CheckpointError, match="checkpoint.allow_pickle"):
        plain.load_checkpoint(root, tag="pickled")
    assert trusting.load_checkpoint(root, tag="pickled")[1] == odd
    plain.destroy()
    trusting.destroy()


class _Exploit:
    def __reduce__(self) -> Any:
        return (os.system, ("echo pwned",))


def _tampered_index(root: str) -> None:
    engine = _quick()
    path = Path(engine.save_checkpoint(root, tag="tampered"))
    dist.barrier()
    if dist.get_rank() == 0:
        (path / ".metadata").write_bytes(pickle.dumps(_Exploit()))
        rehash(path)  # an attacker rewrites them: the restricted unpickler must still refuse
    dist.barrier()
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        engine.load_checkpoint(root, tag="tampered")
    engine.destroy()


def _module_load_fn(root: str, stage: int) -> None:
    source = _quick(stage=stage)
    train(source, 0, 2)
    source.save_checkpoint(root, tag=f"fn{stage}")
    want = full_params(source)
    calls = []

    def load(state_dict: dict[str, torch.Tensor], module: torch.nn.Module) -> None:
        calls.append(sorted(state_dict))
        module.load_state_dict({k: v * 2 for k, v in state_dict.items()})

    target = _quick(stage=stage, seed=9)
    target.load_checkpoint(root, tag=f"fn{stage}", module_load_fn=load)
    assert calls == [sorted(want)], calls
    assert_same(full_params(target), {k: v * 2 for k, v in want.items()}, "after module_load_fn")
    source.destroy()
    target.destroy()


def _module_only(root: str, stage: int) -> None:
    source = _quick(stage=stage)
    train(source, 0, 2)
    source.save_checkpoint(root, tag=f"weights{stage}")
    want = snapshot(source)
    fresh = _quick(stage=stage, seed=9)
    fresh.load_checkpoint(root, tag=f"weights{stage}", load_module_only=True)
    got = snapshot(fresh)
    assert_same(got["params"], want["params"])
    assert got["optim"].keys() == want["optim"].keys() and not any(got["optim"].values()), got["optim"]
    assert fresh.global_steps == 0, "load_module_only must leave the counters (and optimizer) fresh"
    train(fresh, 2, 1)  # a fresh optimizer takes its first step from the loaded weights
    source.destroy()
    fresh.destroy()


class _Renamed(torch.nn.Module):
    """ParityNet's layers under other names, plus a buffer the checkpoint lacks."""

    def __init__(self) -> None:
        super().__init__()
        from _parity import make_model

        net = make_model(seed=4)
        self.embed, self.fc1, self.fc2, self.out = net.embed, net.fc1, net.fc2, net.head
        self.register_buffer("extra", torch.ones(3))

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(self.embed(idx).mean(dim=1)))))
        return torch.nn.functional.mse_loss(self.out(h), target)


def _strictness(root: str) -> None:
    source = _quick()
    source.save_checkpoint(root, tag="strict")
    want = full_params(source)
    other = build(1, model=_Renamed(), checkpoint={"timeout": _TIMEOUT})
    with pytest.raises(CheckpointError) as caught:
        other.load_checkpoint(root, tag="strict")
    assert "out.weight" in str(caught.value) and "head.weight" in str(caught.value) and "extra" in str(caught.value)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        other.load_checkpoint(root, tag="strict", strict=False, load_optimizer_states=False)
    assert any("head.weight" in str(w.message) and "out.bias" in str(w.message) for w in seen), [str(w.message) for w in seen]
    got = full_params(other)
    for name in ("embed.weight", "fc1.weight", "fc2.bias"):
        assert_same(got[name], want[name], name)
    source.destroy()
    other.destroy()


@distributed_test(world_size=2, timeout=240)
def test_pickles_are_refused_and_load_options_work(tmp_path: Path) -> None:
    run_subtests(_pickles, [{"root": str(tmp_path / "pickle")}])
    run_subtests(_tampered_index, [{"root": str(tmp_path / "tampered")}])
    run_subtests(_module_load_fn, [{"root": str(tmp_path / "fn"), "stage": s} for s in (0, 3)])
    run_subtests(_module_only, [{"root": str(tmp_path / "only"), "stage": s} for s in (2, 3)])
    run_subtests(_strictness, [{"root": str(tmp_path / "strict")}])
