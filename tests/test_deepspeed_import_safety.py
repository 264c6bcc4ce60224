"""A DeepSpeed checkpoint is untrusted input too (issue 35): attacks on copies of the repo's own fixtures.

The threat model of docs/checkpoints.md holds for ``engine.load_checkpoint(deepspeed_dir)``: no link is
followed, no record is inflated, no tensor claims more elements than its bytes, every file is bounded by
the model's size, and every shape the files state is checked against the model, by name, before anything
is put together.  Each attack runs in a fresh rank process, must raise a `CheckpointError` saying what is
wrong, leave the engine as it was, and cost less than 200 MB of peak RSS.  Before issue 35 each of them
loaded (several at +1 GiB), raised a raw `RuntimeError`, or blamed the wrong file.
"""

from __future__ import annotations

import functools
import io
import shutil
import zipfile
from pathlib import Path
from typing import Any, Callable, Optional

import _deepspeed_fixture as fx
import pytest
import torch
from _checkpoint_edits import peak_growth_mb

import shardwise
from shardwise.checkpoint import CheckpointError, consolidated_state_dict, load_consolidated
from shardwise.testing import run_distributed

RSS_LIMIT_MB = 200.0
TAG = "global_step4"
STATES = "mp_rank_00_model_states.pt"
MARK = 12345  # the element count of a planted tensor, found and replaced in the pickle


def _copy(case: str, root: Path) -> Path:
    return Path(shutil.copytree(fx.FIXTURES / case, root / case))


def _states(ckpt: Path) -> dict[str, Any]:
    return torch.load(ckpt / TAG / STATES, weights_only=True)  # the fixture: trusted here


def _int_op(value: int) -> bytes:
    """``value`` as a protocol-2 pickle opcode: BININT2 (how torch's pickle writes MARK) or LONG1."""
    if value < 2**16:
        return b"M" + value.to_bytes(2, "little")
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _save_planted(states: dict[str, Any], file: Path, numel: int, record: Optional[str] = None) -> None:
    """``torch.save`` ``states``, then declare every MARK in its pickle as ``numel``; with ``record``
    ("deflated" or "stored"), the planted storage's record becomes ``numel`` float32 zeros written so."""
    buffer = io.BytesIO()
    torch.save(states, buffer)
    source = zipfile.ZipFile(buffer)
    names = [e.filename for e in source.infolist()]
    pickled = next(n for n in names if n.endswith("/data.pkl"))
    planted = next((n for n in names if "/data/" in n and source.getinfo(n).file_size == MARK * 4), None)
    with zipfile.ZipFile(file, "w") as out:
        for name in names:
            if name == pickled:
                data = source.read(name)
                assert data.count(_int_op(MARK)) >= 1
                out.writestr(name, data.replace(_int_op(MARK), _int_op(numel)))
            elif record is not None and name == planted:
                _zeros_entry(out, name, numel * 4, deflated=record == "deflated")
            else:
                out.writestr(name, source.read(name))


def _zeros_entry(out: zipfile.ZipFile, name: str, size: int, deflated: bool) -> None:
    info = zipfile.ZipInfo(name)
    info.compress_type = zipfile.ZIP_DEFLATED if deflated else zipfile.ZIP_STORED
    block = bytes(2**20)
    with out.open(info, "w", force_zip64=True) as entry:
        for _ in range(size // len(block)):
            entry.write(block)


# ------------------------------------------------------------ the attacks
# Each makes a tampered copy under `root` and returns (checkpoint dir, its case, what the error must say,
# whether `consolidate`, which has no model to check against, must refuse it too).

Attack = Callable[[Path], tuple[Path, str, str, bool]]
ATTACKS: dict[str, Attack] = {}


def attack(fn: Attack) -> Attack:
    ATTACKS[fn.__name__] = fn
    return fn


@attack
def states_file_is_a_symlink(root: Path) -> tuple[Path, str, str, bool]:
    ckpt, elsewhere = _copy("z0_fp32", root), _copy("z1_fp32", root / "elsewhere")
    (ckpt / TAG / STATES).unlink()
    (ckpt / TAG / STATES).symlink_to(elsewhere / TAG / STATES)
    return ckpt, "z0_fp32", "is a symbolic link", True


@attack
def optimizer_file_is_a_symlink(root: Path) -> tuple[Path, str, str, bool]:
    ckpt, elsewhere = _copy("z1_fp32", root), _copy("z1_fp32", root / "elsewhere")
    name = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    (ckpt / TAG / name).unlink()
    (ckpt / TAG / name).symlink_to(elsewhere / TAG / name)
    return ckpt, "z1_fp32", "is a symbolic link", True


def _client_tensor(root: Path, numel: int, record: str) -> Path:
    """z0_fp32 with a `client_state` tensor of ``numel`` float32 zeros whose record is written ``record``."""
    ckpt = _copy("z0_fp32", root)
    states = _states(ckpt)
    states["planted"] = torch.zeros(MARK)
    _save_planted(states, ckpt / TAG / STATES, numel, record=record)
    return ckpt


@attack
def record_of_1_mib_inflates_to_1_gib(root: Path) -> tuple[Path, str, str, bool]:
    return _client_tensor(root, 2**28, "deflated"), "z0_fp32", "compressed", True


@attack
def stored_record_of_64_mib_for_a_tiny_model(root: Path) -> tuple[Path, str, str, bool]:
    return _client_tensor(root, 2**24, "stored"), "z0_fp32", "a DeepSpeed file of this model can need", False


def _stride_0(root: Path, case: str, name: str, dtype: torch.dtype, numel: int) -> Path:
    """``case`` with module entry ``name`` a 1-element storage viewed as ``numel`` elements (stride 0)."""
    ckpt = _copy(case, root)
    states = _states(ckpt)
    states["module"][name] = torch.zeros(1, dtype=dtype).expand(MARK)
    _save_planted(states, ckpt / TAG / STATES, numel)
    return ckpt


@attack
def stride_0_tensor_of_2_28_elements(root: Path) -> tuple[Path, str, str, bool]:
    return _stride_0(root, "z0_bf16", "inp.bias", torch.bfloat16, 2**28), "z0_bf16", "a stride-0 view", True


@attack
def stride_0_tensor_of_2_40_elements(root: Path) -> tuple[Path, str, str, bool]:
    return _stride_0(root, "z1_fp32", "out.weight", torch.float32, 2**40), "z1_fp32", "a stride-0 view", True


@attack
def buffer_of_the_wrong_shape(root: Path) -> tuple[Path, str, str, bool]:
    ckpt = _copy("z0_fp32", root)
    states = _states(ckpt)
    states["module"]["shift"] = torch.zeros(7)
    torch.save(states, ckpt / TAG / STATES)
    return ckpt, "z0_fp32", "`shift` is (7,) in the DeepSpeed checkpoint's `module` and (6,) in this model", False


@attack
def param_shapes_edited(root: Path) -> tuple[Path, str, str, bool]:
    ckpt = _copy("z1_fp32", root)
    states = _states(ckpt)
    states["param_shapes"][0]["out.weight"] = torch.Size([4, 17])
    torch.save(states, ckpt / TAG / STATES)
    return ckpt, "z1_fp32", ("`param_shapes` gives `out.weight` as (4, 17), and this model has (4, 16); the same "
                             "file's `module` has it as (4, 16), so `param_shapes` was edited"), False


# ------------------------------------------------------------ run them in a fresh process


def _engine(case: str) -> Any:
    _, stage, dtype = next(c for c in fx.CASES if c[0] == case)
    model = fx.Tiny()
    return shardwise.initialize(model, fx.optimizer(model), fx.config(stage, dtype))


def _params(engine: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _refused(outcome: Any, match: str, growth: float) -> Optional[str]:
    if not isinstance(outcome, CheckpointError):
        return f"not refused: {type(outcome).__name__}: {str(outcome)[:300]}"
    if match not in str(outcome):
        return f"refused, but the message lacks {match!r}: {str(outcome)[:500]}"
    if growth >= RSS_LIMIT_MB:
        return f"peak RSS grew {growth:.0f} MB (limit {RSS_LIMIT_MB:.0f})"
    return None


def _attack_engine(cases: dict[str, tuple[str, str, str, bool]]) -> dict[str, Any]:
    problems, growths = {}, {}
    for name, (load_dir, case, match, also_consolidate) in cases.items():
        engine = _engine(case)
        before = _params(engine)
        ways: list[tuple[str, Callable[[], Any]]] = [("load_checkpoint", functools.partial(engine.load_checkpoint,
                                                                                            load_dir))]
        if also_consolidate:
            ways.append(("consolidate", functools.partial(consolidated_state_dict, load_dir)))
        for way, call in ways:
            outcome, growth = peak_growth_mb(call)
            growths[f"{name} via {way}"] = round(growth, 1)
            problem = _refused(outcome, match, growth)
            if problem is not None:
                problems[f"{name} via {way}"] = problem
        after = _params(engine)
        if engine.global_steps != 0 or any(not torch.equal(v, before[k]) for k, v in after.items()):
            problems[name] = "the refused load changed the engine"
        engine.destroy()
    return {"problems": problems, "growth": growths}


def test_every_attack_on_a_deepspeed_checkpoint_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    cases = {}
    for name, fn in ATTACKS.items():
        ckpt, case, match, also = fn(tmp_path / name)
        cases[name] = (str(ckpt), case, match, also)
    result = run_distributed(_attack_engine, 1, args=(cases,), timeout=300)[0]
    assert not result["problems"], "\n".join(f"{k}: {v}" for k, v in result["problems"].items())
    assert max(result["growth"].values()) < RSS_LIMIT_MB, result["growth"]


def test_a_tag_directory_that_is_a_symlink_is_not_followed(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest").write_text(TAG)
    (ckpt / TAG).symlink_to(fx.FIXTURES / "z0_fp32" / TAG, target_is_directory=True)
    with pytest.raises(CheckpointError, match="symbolic link"):
        consolidated_state_dict(ckpt)


def test_a_consolidated_file_with_a_stride_0_tensor_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "weights.pt"
    _save_planted({"w": torch.zeros(1).expand(MARK)}, file, 2**40)
    with pytest.raises(CheckpointError, match="a stride-0 view"):
        load_consolidated(file)
