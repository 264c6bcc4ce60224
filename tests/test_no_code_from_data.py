"""Nothing in a run directory, a checkpoint or the rendezvous store makes shardwise run code (issue 28).

* ``shardwise generate`` runs the Python file a ``model.json`` names only with
  ``--trust-model-source``; a ``module`` must be installed (not in the current
  directory) and only an ``nn.Module`` subclass is built; ``model.json`` is
  looked up in the checkpoint's and the run directory only.
* The checkpoint agreement's store values are JSON decoded through an
  allow-list: a tampered value (an old-style pickle, an unknown type, a path as a
  file name, a value above the bound) is a named error on every rank, and no
  marker file appears.
"""

from __future__ import annotations

import base64
import json
import pickle
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
from _checkpoint_common import assert_same, build, snapshot, train
from torch import nn

import shardwise.checkpoint.store_codec as store_codec
from shardwise.checkpoint.files import CheckpointError, StoreValueError
from shardwise.cli.commands import main
from shardwise.model_io.generate import ModelSpecError, UntrustedSourceError, find_model_spec, load_model
from shardwise.testing import distributed_test, run_subtests

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# A model file that leaves a marker when it is imported: the proof that it ran.
PLANTED = '''
from pathlib import Path
import torch
from torch import nn

Path({marker!r}).write_text("ran")


class Tiny(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.w = nn.Linear(width, width)

    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float) -> torch.Tensor:
        return torch.cat([idx, torch.full((1, max_new_tokens), ord("x"))], dim=1)
'''


def _plant(run: Path, marker: Path) -> Path:
    """A run directory whose model.json names a relative ``source``; a consolidated file of its weights."""
    run.mkdir(parents=True)
    (run / "planted.py").write_text(PLANTED.format(marker=str(marker)), encoding="utf-8")
    spec = {"source": "planted.py", "class": "Tiny", "config": {"width": 2}, "tokenizer": "bytes"}
    (run / "model.json").write_text(json.dumps(spec), encoding="utf-8")
    state = {f"w.{k}": v for k, v in nn.Linear(2, 2).state_dict().items()}
    torch.save(state, run / "weights.pt")
    return run / "weights.pt"


def test_a_planted_source_runs_only_with_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "marker"
    weights = _plant(tmp_path / "run", marker)
    monkeypatch.chdir(tmp_path)  # a relative `source` is the model.json's, not the current directory's
    assert main(["generate", str(weights), "--tokens", "3"]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "run" / "planted.py") in err and "--trust-model-source" in err, err
    with pytest.raises(UntrustedSourceError):
        load_model(weights)
    assert not marker.exists(), "the planted source ran without --trust-model-source"
    assert main(["generate", str(weights), "--tokens", "3", "--prompt", "ab", "--trust-model-source"]) == 0
    assert capsys.readouterr().out == "abxxx\n" and marker.read_text() == "ran"


def _checkpoint_dir(run: Path) -> tuple[Path, Path]:
    """``run/checkpoints`` with a ``latest`` and one (empty) tag directory holding a manifest."""
    tag = run / "checkpoints" / "global_step1"
    tag.mkdir(parents=True)
    (tag / "shardwise.json").write_text("{}", encoding="utf-8")
    (run / "checkpoints" / "latest").write_text("global_step1", encoding="utf-8")
    return run / "checkpoints", tag


def test_a_model_json_above_the_run_directory_is_not_found(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "marker"
    _plant(tmp_path / "downloads", marker)
    planted = (tmp_path / "downloads" / "model.json").read_text(encoding="utf-8")
    run = tmp_path / "downloads" / "runs" / "gpt"
    checkpoints, tag = _checkpoint_dir(run)
    (tmp_path / "downloads" / "runs" / "model.json").write_text(planted, encoding="utf-8")
    for where in (checkpoints, tag, checkpoints / "final.pt"):
        with pytest.raises(ModelSpecError, match="the only places looked in"):
            find_model_spec(where)
    assert main(["generate", str(tag), "--trust-model-source"]) == 2
    assert "no `model.json`" in capsys.readouterr().err and not marker.exists()
    (run / "model.json").write_text(planted, encoding="utf-8")  # in the run directory: found from each
    assert all(find_model_spec(where) == run / "model.json" for where in (checkpoints, tag, checkpoints / "final.pt"))


def _spec(tmp_path: Path, spec: dict[str, Any]) -> Path:
    (tmp_path / "model.json").write_text(json.dumps({"tokenizer": "bytes", **spec}), encoding="utf-8")
    return tmp_path / "model.json"


def test_a_module_must_be_installed_and_a_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "marker"
    (tmp_path / "plantedmod.py").write_text(f"open({str(marker)!r}, 'w')\n", encoding="utf-8")
    (tmp_path / "w.pt").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend("")  # as `python -m shardwise` has it
    refusals = {
        "plantedmod:Net": ("not installed", {}),
        "subprocess:run": ("not an `nn.Module` subclass", {"args": ["touch", str(marker)]}),
        "torch.nn:Linear": ("is not a dataclass", {"in_features": 1}),
        "../evil:Net": ("expected \"pkg.mod:Class\"", {}),
    }
    for module, (problem, config) in refusals.items():
        extra = {"config_class": "Module"} if module == "torch.nn:Linear" else {}
        with pytest.raises(ModelSpecError, match=problem):
            load_model(tmp_path / "w.pt", _spec(tmp_path, {"module": module, "config": config, **extra}))
    assert not marker.exists() and "plantedmod" not in sys.modules


def test_an_installed_module_needs_no_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))  # installed: on sys.path, and not the current directory
    monkeypatch.delitem(sys.modules, "gpt", raising=False)  # another test may have imported another `gpt`
    from gpt import GPT, gpt_config

    model = GPT(gpt_config("tiny"))
    torch.save(model.state_dict(), tmp_path / "final.pt")
    _spec(tmp_path, {"module": "gpt:GPT", "config_class": "GPTConfig", "config": asdict(model.config)})
    assert main(["generate", str(tmp_path / "final.pt"), "--tokens", "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("def ")


# ----------------------------------------------------------------- the store


def _plan() -> Any:
    from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    index = MetadataIndex("model/master/w", torch.Size([4]), 0)
    chunk = TensorWriteData(ChunkStorageMetadata(torch.Size([4]), torch.Size([3])),
                            TensorProperties(torch.bfloat16, torch.strided, False, torch.contiguous_format, False),
                            torch.Size([7]))
    plan = SavePlan([WriteItem(index, WriteItemType.SHARD, None, chunk)], _StoragePrefix("__1_"), None, True)
    result = WriteResult(index, 12, _StorageInfo("__1_0.distcp", 0, 12, None))
    return [plan, ([result], {"__1_0.distcp": {"size": 12, "sha256": "ab"}, "pair": (1, 2.5)})]


def test_the_store_codec_round_trips_plans_and_refuses_the_rest() -> None:
    value = _plan()
    assert store_codec.loads(store_codec.dumps(value), "k", 0) == value
    refused = {
        '{"SavePlan": {"items": []}}': "fields ['items'], expected",
        '{"MetadataIndex": {"fqn": 3, "offset": null, "index": null}}': "`fqn` is 3",
        '{"dtype": "seed"}': "`dtype` 'seed'",
        '{"Size": [-1]}': "non-negative",
        '{"_StorageInfo": {"relative_path": "../x", "offset": 0, "length": 1, "transform_descriptors": null}}':
            "expected a bare name",
        '{"builtins.eval": "1"}': "tagged 'builtins.eval'",
        "[" * 200 + "]" * 200: "deeper than",
        "\x80\x04K\x01.": "is not JSON",
    }
    for text, says in refused.items():
        with pytest.raises(StoreValueError, match=re.escape("rank 3: the checkpoint agreement's store key `k`")) as caught:
            store_codec.loads(text, "k", 3)
        assert says in str(caught.value), (text, str(caught.value))
    with pytest.raises(StoreValueError, match="holds 'gASV', expected a <class"):  # valid JSON, not a plan
        store_codec.restore(store_codec.encode("gASV"), "k", 3, type(value[0]))
    with pytest.raises(TypeError, match="cannot cross the store"):
        store_codec.dumps(_Plant("never"))


class _Plant:
    """Unpickling this opens (creates) ``marker``: what the old pickle exchange would have done."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return open, (self.marker, "w")


class _Tampered:
    """The rendezvous store, with what this rank writes rewritten by ``rewrite(key, value)``."""

    def __init__(self, store: Any, rewrite: Callable[[str, str], Any]) -> None:
        self._store, self._rewrite = store, rewrite

    def set(self, key: str, value: str) -> None:
        self._store.set(key, self._rewrite(key, value))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def _is_plan(value: Any) -> bool:
    """A rank's save plan, as JSON, or as the base64 pickle shardwise sent before (so this test fails there)."""
    return isinstance(value, str) and ('"SavePlan"' in value or '"data": "gAWV' in value)


def _pickled_plan(marker: str) -> Callable[[str, str], Any]:
    old_style = json.dumps({"error": None, "data": base64.b64encode(pickle.dumps(_Plant(marker), protocol=4)).decode()})
    return lambda key, value: old_style if _is_plan(value) else value


def _unknown_type(marker: str) -> Callable[[str, str], Any]:
    forged = json.dumps({"error": None, "data": {"os.system": f"touch {marker}"}})
    return lambda key, value: forged if _is_plan(value) else value


def _raw_pickle(marker: str) -> Callable[[str, str], Any]:
    return lambda key, value: pickle.dumps(_Plant(marker)) if _is_plan(value) else value


def _path_as_file_name(marker: str) -> Callable[[str, str], Any]:
    return lambda key, value: value.replace('"prefix":"__1_"', f'"prefix":"{marker}_"')


_ATTACKS: dict[str, tuple[Optional[int], Callable[[str], Callable[[str, str], Any]], str]] = {
    # name: (the rank that tampers, the rewrite, what the error says)
    "an old-style pickle as the plan": (1, _pickled_plan, "holds 'gASV"),
    "an object of an unknown type": (1, _unknown_type, "tagged 'os.system'"),
    "a pickle in place of JSON": (1, _raw_pickle, "is not JSON"),
    "a path as the file prefix": (0, _path_as_file_name, "expected a bare name"),
}


def _attack(root: str, name: str) -> None:
    rank = dist.get_rank()
    tamperer, rewrite, says = _ATTACKS[name]
    marker = str(Path(root) / f"marker-{name.replace(' ', '-')}")
    engine = build(2)
    train(engine, 0, 1)
    real = dist.distributed_c10d._get_default_store
    if rank == tamperer:
        dist.distributed_c10d._get_default_store = lambda: _Tampered(real(), rewrite(marker))  # type: ignore[assignment]
    try:
        with pytest.raises(StoreValueError) as caught:
            engine.save_checkpoint(Path(root) / "ck")
    finally:
        dist.distributed_c10d._get_default_store = real  # type: ignore[assignment]
    message = str(caught.value)
    assert f"rank {rank}: the checkpoint agreement's store key" in message and says in message, message
    assert not Path(marker).exists() and not list(Path(root).glob("**/*marker*")), "a tampered value ran code"
    # the ranks realign: the next save works, and loads back into another engine bit for bit
    saved = engine.save_checkpoint(Path(root) / "ck")
    other = build(2, seed=3)
    assert other.load_checkpoint(Path(root) / "ck")[0] == saved
    assert_same(snapshot(other), snapshot(engine), "reloaded after the refused saves")
    engine.destroy()
    other.destroy()


def _oversize(root: str) -> None:
    engine = build(2)
    train(engine, 0, 1)
    bound = store_codec.MAX_STORE_VALUE_BYTES
    store_codec.MAX_STORE_VALUE_BYTES = 4000  # the local plan is ~12 KB of JSON
    try:
        with pytest.raises(CheckpointError, match="above the store's bound of 4,000"):
            engine.save_checkpoint(Path(root) / "big")
    finally:
        store_codec.MAX_STORE_VALUE_BYTES = bound
    engine.destroy()


@distributed_test(world_size=2, timeout=240)
def test_a_tampered_store_value_is_a_named_error_on_every_rank(tmp_path: Path) -> None:
    run_subtests(_attack, [{"root": str(tmp_path / f"case{i}"), "name": name} for i, name in enumerate(_ATTACKS)])
    _oversize(str(tmp_path))
