"""Checkpoints: bit-exact resume, resharding across world sizes and ZeRO stages, consolidation.

Every comparison here is exact (``torch.equal``): a checkpoint stores fp32
master weights and optimizer state as they are, so nothing may move.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _checkpoint_common import TiedNet, assert_same, build, config, noisy_model, snapshot, tied_model, train
from _parity import make_model

import shardwise
from shardwise.checkpoint import consolidate, load_consolidated
from shardwise.testing import distributed_test, run_distributed, run_subtests

_FP16 = {"fp16": {"enabled": True, "initial_scale_power": 24, "loss_scale_window": 2, "hysteresis": 1}}


def _reinit(rendezvous: Path) -> None:
    """Tear the process group down and build a new one, as a restarted job would."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)


def _resume_case(root: str, stage: int, fp16: bool = False, frozen: tuple[str, ...] = ()) -> None:
    sections: dict[str, Any] = {**(_FP16 if fp16 else {}), "frozen": frozen}
    where = Path(root) / f"stage{stage}{'-fp16' if fp16 else ''}{'-frozen' if frozen else ''}"
    # Dropout: the losses after the resume match only if each rank's RNG state was restored as well
    reference = build(stage, model=noisy_model(), **sections)
    want_losses = train(reference, 0, 6)
    want = snapshot(reference)
    want_scaler = reference.precision.scaler.state_dict()
    want_counters = (reference.global_steps, reference.micro_steps, reference.skipped_steps)
    reference.destroy()
    if fp16:
        assert reference.skipped_steps > 0, "the fp16 case must exercise the loss scaler (no overflow happened)"

    first = build(stage, model=noisy_model(), **sections)
    losses = train(first, 0, 3)
    client = {"epoch": 1, "note": "resume", "pair": (1, 2.5), "seen": torch.arange(4)}
    saved = first.save_checkpoint(where, client_state=client)
    first.destroy()
    _reinit(where.with_suffix(".rendezvous"))

    # another init (and RNG state): everything must come from the checkpoint
    second = build(stage, model=noisy_model(seed=7), **sections)
    loaded_path, loaded = second.load_checkpoint(where)
    assert loaded_path == saved, f"loaded {loaded_path}, saved {saved}"
    losses += train(second, 3, 3)
    assert losses == want_losses, f"losses {losses} != uninterrupted {want_losses}"
    assert_same(snapshot(second), want, "after resume")
    assert second.precision.scaler.state_dict() == want_scaler
    assert (second.global_steps, second.micro_steps, second.skipped_steps) == want_counters
    assert_same(loaded, client, "client_state")
    second.destroy()


@distributed_test(world_size=2, timeout=240)
def test_resume_is_bit_exact(tmp_path: Path) -> None:
    """6 steps == 3 steps, save, new process group, load into a fresh engine, 3 steps; fp16 scaler too.

    The fresh engine starts from other random weights and another RNG state, and the model has dropout,
    so everything (each rank's RNG state included) must come from the checkpoint.
    """
    cases: list[dict[str, Any]] = [{"stage": s} for s in (0, 1, 2, 3)]
    cases += [{"stage": 1, "fp16": True}, {"stage": 3, "fp16": True}]
    # A frozen weight next to its trainable bias (one stage-3 unit): saved as a module entry.
    cases += [{"stage": s, "frozen": ("fc1.weight",)} for s in (1, 3)]
    run_subtests(_resume_case, [{"root": str(tmp_path), **c} for c in cases])


# ------------------------------------------------------------------ resharding

_SAVED_STAGES = (0, 1, 2, 3)


def _save_each_stage(root: str) -> dict[int, Any]:
    saved = {}
    for stage in _SAVED_STAGES:
        engine = build(stage)
        train(engine, 0, 3)
        engine.save_checkpoint(Path(root) / f"stage{stage}")
        saved[stage] = snapshot(engine)
        engine.destroy()
    return saved


def _load_resharded(root: str, saved: dict[int, Any], source: int, target: int) -> None:
    engine = build(target, seed=7)
    engine.load_checkpoint(Path(root) / f"stage{source}")
    assert_same(snapshot(engine), saved[source], f"stage {source} at 2 ranks -> stage {target} at {dist.get_world_size()}")
    assert engine.global_steps == 3
    losses = train(engine, 3, 2)
    assert all(math.isfinite(x) for x in losses) and engine.global_steps == 5
    after = snapshot(engine)["params"]
    assert all(torch.isfinite(v).all() for v in after.values())
    assert not any(torch.equal(after[k], v) for k, v in saved[source]["params"].items()), "training did not move the weights"
    engine.destroy()


def test_reshard_across_world_sizes_and_stages(tmp_path: Path) -> None:
    """Saved at 2 ranks for every stage; loaded at 1 and at 3 ranks into other stages."""
    saved = run_distributed(_save_each_stage, 2, args=(str(tmp_path),), timeout=180)[0]
    to_one = [(0, 3), (3, 0), (2, 1), (1, 3), (3, 3), (1, 2)]
    to_three = [(0, 2), (1, 0), (2, 3), (3, 1), (3, 3), (0, 1)]
    for world, pairs in ((1, to_one), (3, to_three)):
        cases = [{"root": str(tmp_path), "saved": saved, "source": s, "target": t} for s, t in pairs]
        run_distributed(run_subtests, world, args=(_load_resharded, cases), timeout=180)


# ---------------------------------------------------------------- consolidation


def _gpt(seed: int = 0) -> Any:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from gpt import GPT, gpt_config

    torch.manual_seed(seed)
    return GPT(gpt_config("tiny", vocab_size=64, block_size=16))


def _train_gpt(engine: Any, steps: int) -> None:
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        idx = torch.randint(0, 64, (2, 16), generator=gen)
        _, loss = engine(idx, torch.roll(idx, -1, dims=1))
        engine.backward(loss)
        engine.step()


def _save_for_export(root: str) -> dict[str, Any]:
    from _checkpoint_common import config

    import shardwise

    exported = {}
    for stage in (0, 3):
        engine = build(stage, model=tied_model())
        train(engine, 0, 2)
        engine.save_checkpoint(Path(root) / f"tied{stage}")
        exported[f"tied{stage}"] = engine.full_state_dict()
        engine.destroy()
    model = _gpt()
    gpt = shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config(3))
    _train_gpt(gpt, 2)
    gpt.save_checkpoint(Path(root) / "gpt3", tag="final")
    exported["gpt3"] = gpt.full_state_dict()
    gpt.destroy()
    return exported


def test_consolidate_equals_full_state_dict_and_loads_into_plain_model(tmp_path: Path, capsys: Any) -> None:
    exported = run_distributed(_save_for_export, 2, args=(str(tmp_path),), timeout=180)[0]
    for name, want in exported.items():
        for suffix in (".safetensors", ".pt"):
            out = tmp_path / f"{name}{suffix}"
            summary = consolidate(tmp_path / name, out)
            got = load_consolidated(out)
            assert list(got) == list(want), f"{out}: key order"
            assert_same(got, want, str(out))
            plain = _gpt(seed=3) if name == "gpt3" else tied_model(seed=3)
            plain.load_state_dict(got, strict=True)
            assert_same({k: v.float() for k, v in plain.state_dict().items()}, want, f"{out} loaded")
            if isinstance(plain, TiedNet):
                assert summary["aliases"] == {"head.weight": "embed.weight"}
                assert got["head.weight"].data_ptr() == got["embed.weight"].data_ptr()
                assert plain.head.weight is plain.embed.weight  # load_state_dict kept the tie
    _check_cli(tmp_path, capsys)


def _check_cli(root: Path, capsys: Any) -> None:
    from shardwise.cli.commands import main

    assert main(["checkpoint", "inspect", str(root / "tied3")]) == 0
    text = capsys.readouterr().out
    assert "world size 2" in text and "ZeRO stage 3" in text and "global step 2" in text and "(latest)" in text
    assert main(["checkpoint", "inspect", str(root / "gpt3" / "final")]) == 0
    assert "final" in capsys.readouterr().out
    out = root / "cli.safetensors"
    assert main(["checkpoint", "consolidate", str(root / "gpt3"), "--tag", "final", "--out", str(out)]) == 0
    assert "cli.safetensors" in capsys.readouterr().out
    assert_same(load_consolidated(out), load_consolidated(root / "gpt3.pt"))
    assert main(["checkpoint", "consolidate", str(root / "missing"), "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err


def _save_client_state(root: str, pickled: bool) -> None:
    engine = build(2, **({"checkpoint": {"allow_pickle": True}} if pickled else {}))
    train(engine, 0, 1)
    state: dict[str, Any] = {"epoch": 3, "score": torch.tensor([0.25, 0.5]), "names": ("a", "b"), "nested": {"k": [1.5]}}
    if pickled:
        state["path"] = Path("/x")  # a type JSON lacks: stored only with allow_pickle
    engine.save_checkpoint(root, tag="t", client_state=state)
    engine.destroy()


def test_consolidated_client_state_reads_what_load_checkpoint_returns(tmp_path: Path) -> None:
    from shardwise.checkpoint import CheckpointError, consolidated_client_state

    run_distributed(_save_client_state, 2, args=(str(tmp_path / "plain"), False), timeout=120)
    got = consolidated_client_state(tmp_path / "plain")
    assert got["epoch"] == 3 and got["names"] == ("a", "b") and got["nested"] == {"k": [1.5]}
    assert torch.equal(got["score"], torch.tensor([0.25, 0.5]))
    run_distributed(_save_client_state, 2, args=(str(tmp_path / "pickled"), True), timeout=120)
    try:
        consolidated_client_state(tmp_path / "pickled", tag="t")
    except CheckpointError as exc:
        assert "allow_pickle" in str(exc)
    else:
        raise AssertionError("a pickled client_state entry was read without allow_pickle")
    assert consolidated_client_state(tmp_path / "pickled", allow_pickle=True)["path"] == Path("/x")


def _load_into_inference_engine(root: str) -> None:
    def case(save_stage: int, load_stage: int) -> None:
        where = str(Path(root) / f"{save_stage}-{load_stage}")
        trained = build(save_stage)
        train(trained, 0, 2)
        trained.save_checkpoint(where, tag="t")
        want = trained.full_state_dict()
        trained.destroy()
        inference = shardwise.initialize(make_model(seed=5), config=config(load_stage))  # no optimizer: no masters
        inference.load_checkpoint(where, load_optimizer_states=False, load_lr_scheduler_states=False)
        got = inference.full_state_dict()
        if dist.get_rank() == 0:
            assert_same(got, want, f"stage {save_stage} -> inference stage {load_stage}")
        inference.destroy()

    run_subtests(case, [{"save_stage": 2, "load_stage": 2}, {"save_stage": 1, "load_stage": 3},
                        {"save_stage": 3, "load_stage": 0}])


def test_an_engine_without_optimizer_loads_the_saved_weights(tmp_path: Path) -> None:
    """Trained parameters are saved as masters; an inference engine keeps none, so each is read into a module
    buffer, which must be filled before the engine installs it (it once installed uninitialized memory)."""
    run_distributed(_load_into_inference_engine, 2, args=(str(tmp_path),), timeout=180)
