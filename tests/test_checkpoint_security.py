"""Checkpoints as untrusted input (issue 17): one test per attack, each built from a real checkpoint.

Every attack must be refused with a `CheckpointError` that names the file or
field, write nothing outside the target, and cost the loading process less
than 200 MB of peak RSS (measured in a fresh rank process, per attack).
"""

from __future__ import annotations

import functools
import hashlib
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
from _checkpoint_common import assert_same, build, full_params, tied_model, train
from _checkpoint_edits import (
    TAG,
    copy_save_dir,
    deflated_record,
    edit_index,
    edit_json,
    edit_manifest,
    peak_growth_mb,
    save_base,
    storage_of,
)
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, ChunkStorageMetadata

from shardwise.checkpoint import CheckpointError, consolidated_state_dict, describe, load_consolidated
from shardwise.checkpoint.layout import validate_tag
from shardwise.cli.commands import main
from shardwise.testing import distributed_test, run_distributed, run_subtests

RSS_LIMIT_MB = 200.0
MB = 2**20


def _save_pair(root: str) -> None:
    save_base(str(Path(root) / "save"))
    save_base(str(Path(root) / "other"), seed=7)  # another directory's checkpoint: what a traversal would reach


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("security")
    run_distributed(_save_pair, 2, args=(str(root),), timeout=180)
    return root


# ------------------------------------------------------------ the attacks
# Each edits `save` (a copy of the real checkpoint's save_dir; `other` sits beside it) and
# returns (load_dir, tag, what the error must say).

Attack = Callable[[Path, Path], tuple[Path, Optional[str], str]]
ATTACKS: dict[str, Attack] = {}


def attack(fn: Attack) -> Attack:
    ATTACKS[fn.__name__] = fn
    return fn


@attack
def latest_climbs_out(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    (save / "latest").write_text("../other/step2")
    return save, None, "is not a checkpoint tag"


@attack
def latest_absolute(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    (save / "latest").write_text(str(other / TAG))
    return save, None, "is not a checkpoint tag"


@attack
def tag_climbs_out(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    return save, "../other/step2", "is not the name of a checkpoint"


@attack
def tag_is_symlink(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    (save / "linked").symlink_to(other / TAG, target_is_directory=True)
    return save, "linked", "symbolic link"


@attack
def latest_is_symlink(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    (save / "latest").unlink()
    (save / "latest").symlink_to(other / "latest")
    return save, None, "symbolic link"


@attack
def latest_is_fifo(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    (save / "latest").unlink()
    os.mkfifo(save / "latest")  # opening it for reading without O_NONBLOCK would hang
    return save, None, "not a regular file"


@attack
def manifest_is_symlink(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    (save / TAG / "shardwise.json").unlink()
    (save / TAG / "shardwise.json").symlink_to(other / TAG / "shardwise.json")
    return save, None, "symbolic link"


def _first_record_path(save: Path, path: str) -> None:
    def edit(metadata: Any) -> None:
        next(iter(metadata.storage_data.values())).relative_path = path

    edit_index(save / TAG, edit)


@attack
def chunk_path_absolute(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    _first_record_path(save, str(other / TAG / "__0_0.distcp"))
    return save, None, "relative_path"


@attack
def chunk_path_climbs_out(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    _first_record_path(save, "../../other/step2/__0_0.distcp")
    return save, None, "relative_path"


@attack
def shape_of_4_tb(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    edit_manifest(save / TAG, lambda m: m["params"]["mid.weight"].update(shape=[10**6, 10**6]))
    return save, None, "tensor index"


@attack
def shape_of_8_gib_in_manifest_and_index(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    numel = 2**31
    edit_manifest(save / TAG, lambda m: m["params"]["mid.bias"].update(shape=[numel]))

    def edit(metadata: Any) -> None:
        entry = metadata.state_dict_metadata["model/master/mid.bias"]
        entry.size = torch.Size([numel])
        entry.chunks = [ChunkStorageMetadata(torch.Size([0]), torch.Size([numel]))]

    edit_index(save / TAG, edit)
    return save, None, "less than the 8589934592 its chunk holds"


@attack
def records_shared_by_many_tensors(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    """64 more "parameters" whose chunks all point at embed.weight's bytes: 64x the output from nothing."""
    source = "model/master/embed.weight"

    def edit(metadata: Any) -> None:
        for i in range(64):
            metadata.state_dict_metadata[f"model/master/ghost{i}"] = metadata.state_dict_metadata[source]
            for key, info in storage_of(metadata, source):
                metadata.storage_data[type(key)(f"model/master/ghost{i}", key.offset)] = info

    edit_index(save / TAG, edit)
    edit_manifest(save / TAG, lambda m: m["params"].update({f"ghost{i}": {"shape": [64, 16]} for i in range(64)}))
    return save, None, "overlap"


@attack
def latest_of_1_gib(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    os.truncate(save / "latest", 2**30)  # sparse: costs no disk
    return save, None, "more than the 4,096"


@attack
def manifest_of_300_mib(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    os.truncate(save / TAG / "shardwise.json", 300 * MB)
    return save, None, "more than the 268,435,456"


@attack
def client_tensor_of_4_tib(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    edit_manifest(save / TAG, lambda m: m["client_state"]["t"].update(shape=[2**40]))
    return save, None, "tensor index"


@attack
def record_that_inflates_to_300_mib(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    deflated_record(save / TAG, "model/master/embed.weight", 300 * MB)
    return save, None, "compressed"


@attack
def chunks_cover_half_a_tensor(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    def edit(metadata: Any) -> None:
        entry = metadata.state_dict_metadata["model/master/embed.weight"]
        entry.size = torch.Size([entry.size[0] * 2])

    edit_index(save / TAG, edit)
    edit_manifest(save / TAG, lambda m: m["params"]["embed.weight"].update(shape=[128, 16]))
    return save, None, "cover elements"


@attack
def dtype_tag_names_a_function(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    edit_manifest(save / TAG, lambda m: m["precision"]["scaler"].update(scale={"__dtype__": "seed"}))
    return save, None, "`__dtype__` is 'seed', which is not a torch dtype"


@attack
def dtype_tag_names_a_module(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    edit_manifest(save / TAG, lambda m: m["client_state"].update(x={"__dtype__": "os"}))
    return save, None, "`__dtype__` is 'os'"


@attack
def counter_that_is_no_counter(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    edit_manifest(save / TAG, lambda m: m["counters"].update(gradient_accumulation_steps=1000000))
    return save, None, "counters.gradient_accumulation_steps"


@attack
def world_size_as_text(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    edit_manifest(save / TAG, lambda m: m.update(world_size="2"))
    return save, None, "shardwise.json: `world_size`"


@attack
def alias_to_nothing(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    edit_manifest(save / TAG, lambda m: m["aliases"].update({"head.weight": "nowhere"}))
    return save, None, "aliases.head.weight"


@attack
def nesting_600_deep(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    deep: Any = 0
    for _ in range(600):
        deep = [deep]
    edit_manifest(save / TAG, lambda m: m["client_state"].update(deep=deep))
    return save, None, "nests values more than 100 deep"


@attack
def nesting_beyond_the_json_parser(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    file = save / TAG / "shardwise.json"
    file.write_text(file.read_text().replace('"epoch": 3', '"epoch": ' + "[" * 100000 + "]" * 100000))
    return save, None, "nests its values too deeply"


@attack
def bad_value_after_a_million_deep_under_a_long_key(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    """Where each value sits must not cost a string per value (90 levels x 50 KB key x 1M values)."""
    inner: Any = [0] * 1_000_000 + [{"__dtype__": "os"}]
    for _ in range(90):
        inner = [inner]
    edit_manifest(save / TAG, lambda m: m["client_state"].update({"k" * 50_000: inner}))
    return save, None, "`__dtype__` is 'os'"


@attack
def index_entry_is_a_pickle(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    edit_index(save / TAG, lambda md: md.state_dict_metadata.update({"model/master/mid.bias": BytesStorageMetadata()}))
    return save, None, "pickled object"


@attack
def record_needs_a_stream_transform(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    edit_index(save / TAG, lambda md: setattr(next(iter(md.storage_data.values())), "transform_descriptors", ["zstd"]))
    return save, None, "stream transforms"


@attack
def deepspeed_directory(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    ds = save.parent / "deepspeed"
    (ds / "global_step10").mkdir(parents=True)
    (ds / "latest").write_text("global_step10")
    torch.save({"module": {}}, ds / "global_step10" / "mp_rank_00_model_states.pt")
    torch.save({}, ds / "global_step10" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    # read as a DeepSpeed checkpoint (deepspeed_format.py), whose optimizer file is not one
    return ds, None, "which every DeepSpeed optimizer file has"


@attack
def plain_dcp_directory(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    import torch.distributed.checkpoint as dcp

    plain = save.parent / "plain_dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: assuming a single process", which is the point
        dcp.save({"w": torch.ones(3)}, checkpoint_id=str(plain), no_dist=True)
    return plain, None, "plain `torch.distributed.checkpoint` directory"


@attack
def torch_save_file(save: Path, other: Path) -> tuple[Path, Optional[str], str]:
    file = save.parent / "weights.pt"
    torch.save(tied_model(0).state_dict(), file)
    return file, None, "saved with `torch.save`"


def _prepare(base: Path, root: Path) -> dict[str, tuple[str, Optional[str], str]]:
    cases = {}
    for name, fn in ATTACKS.items():
        case = root / name
        save = copy_save_dir(base / "save", case / "save")
        other = copy_save_dir(base / "other", case / "other")
        load_dir, tag, match = fn(save, other)
        cases[name] = (str(load_dir), tag, match)
    return cases


def _fingerprint(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()
    }


# ------------------------------------------------------------ run them in a fresh process


def _refused(outcome: Any, match: str, growth: float) -> Optional[str]:
    if not isinstance(outcome, CheckpointError):
        return f"not refused: {type(outcome).__name__}: {str(outcome)[:300]}"
    if match not in str(outcome):
        return f"refused, but the message lacks {match!r}: {str(outcome)[:400]}"
    if growth >= RSS_LIMIT_MB:
        return f"peak RSS grew {growth:.0f} MB (limit {RSS_LIMIT_MB:.0f})"
    return None


def _attack_engine(cases: dict[str, tuple[str, Optional[str], str]]) -> dict[str, Any]:
    """(one rank) Each attack through `engine.load_checkpoint` and through `consolidated_state_dict`."""
    engine = build(2, seed=3, model=tied_model(3))
    before, steps = full_params(engine), engine.global_steps
    problems, growths = {}, {}
    for name, (load_dir, tag, match) in cases.items():
        for way, call in (
            ("load_checkpoint", functools.partial(engine.load_checkpoint, load_dir, tag=tag)),
            ("consolidate", functools.partial(consolidated_state_dict, load_dir, tag)),
        ):
            outcome, growth = peak_growth_mb(call)
            growths[f"{name} via {way}"] = round(growth, 1)
            problem = _refused(outcome, match, growth)
            if problem is not None:
                problems[f"{name} via {way}"] = problem
        if engine.global_steps != steps or any(not torch.equal(v, before[k]) for k, v in full_params(engine).items()):
            problems[name] = "the refused load changed the engine"
    engine.destroy()
    return {"problems": problems, "growth": growths}


def test_every_attack_is_refused_in_bounded_memory(base: Path, tmp_path: Path) -> None:
    cases = _prepare(base, tmp_path)
    victims = {name: _fingerprint(tmp_path / name / "other") for name in cases}
    result = run_distributed(_attack_engine, 1, args=(cases,), timeout=240)[0]
    assert not result["problems"], "\n".join(f"{k}: {v}" for k, v in result["problems"].items())
    assert max(result["growth"].values()) < RSS_LIMIT_MB, result["growth"]
    for name in cases:
        assert _fingerprint(tmp_path / name / "other") == victims[name], f"{name} changed another directory"


# ------------------------------------------------------------ two ranks: writes, RNG, every rank raises


def _victims(root: Path) -> tuple[Path, Path]:
    victim_file, victim_dir = root / "victim.txt", root / "victim_dir"
    if dist.get_rank() == 0:
        victim_file.write_text("precious")
        victim_dir.mkdir()
        (victim_dir / "keep.txt").write_text("keep")
    dist.barrier()
    return victim_file, victim_dir


def _writes_stay_inside(root: str) -> None:
    """Links planted where a save writes (`latest`, the tag, the old predictable temporary names)."""
    base = Path(root)
    save = base / "save"
    save.mkdir(parents=True, exist_ok=True)
    victim_file, victim_dir = _victims(base)
    pids: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    if dist.get_rank() == 0:
        for pid in pids:  # the names the old `write_atomic` used, for every rank's pid
            (save / f".tmp-latest.{pid}").symlink_to(victim_file)
        (save / "latest").symlink_to(victim_file)
        (save / "planted").symlink_to(victim_dir, target_is_directory=True)
    dist.barrier()
    engine = build(2, model=tied_model(0))
    train(engine, 0, 1)
    engine.save_checkpoint(save, tag="planted")
    assert victim_file.read_text() == "precious" and sorted(os.listdir(victim_dir)) == ["keep.txt"]
    assert not (save / "latest").is_symlink() and (save / "latest").read_text() == "planted"
    assert not (save / "planted").is_symlink() and (save / "planted" / "shardwise.json").is_file()
    want = full_params(engine)
    fresh = build(2, seed=5, model=tied_model(5))
    assert fresh.load_checkpoint(save)[0] == str(save / "planted")
    assert_same(full_params(fresh), want, "after a save among planted links")
    engine.destroy()
    fresh.destroy()


def _every_rank_refuses(root: str, edit: str) -> None:
    """An attack on one rank's file (or on `latest`) makes every rank raise, and no rank's engine changes."""
    save = Path(root) / edit
    save_base(str(save))
    if dist.get_rank() == 0:
        if edit == "rng":  # rank 1's Python RNG state, cut short: caught before anything is applied
            edit_json(save / TAG / "rank1.json", lambda r: r["rng"]["python"]["__tuple__"][1].update(__tuple__=[1, 2]))
        else:
            (save / "latest").write_text("../../etc")
    dist.barrier()
    engine = build(2, seed=3, model=tied_model(3))
    train(engine, 0, 1)
    before, steps = full_params(engine), engine.global_steps
    with pytest.raises(CheckpointError) as caught:
        engine.load_checkpoint(save)
    message = str(caught.value)
    if edit == "rng":
        assert "rank1.json" in message and "rng.python" in message, message
    else:
        assert "is not a checkpoint tag" in message, message
    assert engine.global_steps == steps
    assert_same(full_params(engine), before, "after a refused load")
    train(engine, 1, 1)  # the ranks are still in step
    engine.destroy()


@distributed_test(world_size=2, timeout=240)
def test_two_ranks_write_only_inside_and_refuse_together(tmp_path: Path) -> None:
    run_subtests(_writes_stay_inside, [{"root": str(tmp_path / "writes")}])
    run_subtests(_every_rank_refuses, [{"root": str(tmp_path / "refuse"), "edit": e} for e in ("rng", "latest")])


# ------------------------------------------------------------ one process: CLI, tags, formats


def test_cli_out_is_written_through_no_link_and_errors_are_one_line(
    base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out" / "model.pt"
    out.parent.mkdir()
    out.symlink_to(victim)
    (out.parent / f".tmp-model.pt.{os.getpid()}").symlink_to(victim)  # the old predictable name
    assert main(["checkpoint", "consolidate", str(base / "save"), "--out", str(out)]) == 0
    assert victim.read_text() == "precious"
    assert not out.is_symlink()
    assert_same(torch.load(out, weights_only=True), consolidated_state_dict(base / "save"))
    capsys.readouterr()

    bad = copy_save_dir(base / "save", tmp_path / "bad")
    edit_manifest(bad / TAG, lambda m: m.update(params=[1, 2]))
    assert main(["checkpoint", "consolidate", str(bad), "--out", str(tmp_path / "x.pt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "shardwise.json: `params`" in err and "Traceback" not in err, err
    assert main(["checkpoint", "inspect", str(bad)]) == 0
    assert "BROKEN" in capsys.readouterr().out
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    assert main(["checkpoint", "inspect", str(tmp_path / "w.pt")]) == 2
    assert "saved with `torch.save`" in capsys.readouterr().err
    assert not (tmp_path / "x.pt").exists()


def test_tags_are_one_name(base: Path, tmp_path: Path) -> None:
    for tag in ("step\n", "a/b", "..", ".hidden", "-x", "latest", "x" * 256, "step\x00", 5):
        with pytest.raises(CheckpointError, match="cannot name a checkpoint directory"):
            validate_tag(tag)
    assert validate_tag("global_step10.v2+a=b") == "global_step10.v2+a=b"
    save = copy_save_dir(base / "save", tmp_path / "save")
    (save / "latest").write_text(TAG + "\n")  # a hand-edited `latest` with a newline still loads
    assert_same(consolidated_state_dict(save), consolidated_state_dict(base / "save"))
    with pytest.raises(CheckpointError, match="is not the name of a checkpoint"):
        consolidated_state_dict(save, "step2\n")


def test_describe_names_other_formats(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "zero_to_fp32.py").write_text("# DeepSpeed's converter")
    with pytest.raises(CheckpointError, match="DeepSpeed checkpoint.*zero_to_fp32.py"):
        describe(ds)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="Hugging Face"):
        consolidated_state_dict(hf)


def test_size_limits_are_far_above_real_checkpoints(base: Path) -> None:
    from shardwise.checkpoint import files as limits

    ckpt = base / "save" / TAG
    assert (ckpt / "shardwise.json").stat().st_size * 1000 < limits.MAX_MANIFEST_BYTES
    assert (ckpt / "rank0.json").stat().st_size * 100 < limits.MAX_RANK_FILE_BYTES
    assert (ckpt / ".metadata").stat().st_size * 1000 < limits.MAX_INDEX_BYTES


def test_load_consolidated_refuses_a_file_that_inflates(tmp_path: Path) -> None:
    import zipfile

    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.zeros(1000)}, plain)
    assert torch.equal(load_consolidated(plain)["w"], torch.zeros(1000))
    deflated = tmp_path / "deflated.pt"
    with zipfile.ZipFile(plain) as source, zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as target:
        for entry in source.infolist():
            target.writestr(entry.filename, source.read(entry.filename))
    with pytest.raises(CheckpointError, match="compressed"):
        load_consolidated(deflated)
