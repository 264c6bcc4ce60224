"""Checks of a checkpoint's manifest and rank files, of their agreement with the tensor index, and of decoded values.

Nothing a checkpoint says is used before it passes here (docs/checkpoints.md, "Nothing applied until everything checks
out" and "Threat model"): field types (pydantic, strict: ``1`` is not ``true``), names that must resolve, encoded values
that must decode, and every shape the load will allocate from, which must equal that tensor's size in the index.
Decoded states are checked by :func:`conform` against the live object's (the *template*); :func:`check_complete` tells
a complete, intact checkpoint from a broken one first.
"""

from __future__ import annotations

import math
import random
import re
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn, Optional

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from . import files
from .codec import TENSOR_DTYPES, Decoder, check_encoded
from .files import HINT, MAX_DIMS, MAX_WORLD_SIZE, CheckpointError, fail, read_json, regular_size
from .layout import FORMAT, INDEX, LATEST, MANIFEST, TEMP_PREFIX, VERSION, foreign_format, rank_file, tags
from .storage import read_metadata, record_ends

__all__ = ["check_against_index", "check_complete", "check_manifest", "check_rank_file", "conform", "read_rank_file"]


def _tensor_dtype(name: str) -> str:
    if name not in TENSOR_DTYPES:
        raise ValueError(f"{name!r:.40} is not a tensor dtype shardwise stores")
    return name


_Count = Annotated[int, Field(ge=0)]
_Shape = Annotated[list[_Count], Field(max_length=MAX_DIMS)]
_Dtype = Annotated[str, AfterValidator(_tensor_dtype)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)


class _Param(_Strict):
    shape: _Shape
    group: _Count = 0


class _ModuleEntry(_Strict):
    shape: _Shape
    dtype: _Dtype


class _StateEntry(_Strict):
    kind: Literal["chunked", "tensor", "value"]
    dtype: Optional[_Dtype] = None
    shape: Optional[_Shape] = None

    @model_validator(mode="after")
    def _complete(self) -> "_StateEntry":
        needed = {"chunked": ("dtype",), "tensor": ("dtype", "shape"), "value": ()}[self.kind]
        absent = [n for n in needed if getattr(self, n) is None]
        if self.kind == "value" and "value" not in (self.model_extra or {}):
            absent.append("value")
        if absent:
            raise ValueError(f"a `{self.kind}` entry needs {absent}")
        return self


class _Optimizer(_Strict):
    cls: str = Field(alias="class")
    param_groups: Optional[list[Any]] = None
    state: dict[str, dict[str, _StateEntry]]


class _Counters(_Strict):
    model_config = ConfigDict(strict=True, extra="forbid")
    global_steps: _Count
    micro_steps: _Count
    skipped_steps: _Count


class _Manifest(_Strict):
    tag: str
    world_size: Annotated[int, Field(ge=1, le=MAX_WORLD_SIZE)]
    stage: Annotated[int, Field(ge=0, le=3)]
    dtype: _Dtype
    counters: _Counters
    state_dict_keys: list[str]
    aliases: dict[str, str]
    params: dict[str, _Param]
    module: dict[str, _ModuleEntry]
    optimizer: Optional[_Optimizer] = None
    scheduler: Optional[dict[str, Any]] = None
    precision: dict[str, Any]
    client_state: Any
    rng: bool = False


class _RankFile(_Strict):
    rank: _Count
    world_size: Annotated[int, Field(ge=1, le=MAX_WORLD_SIZE)]
    rng: Optional[dict[str, Any]] = None


def _schema(model: type[BaseModel], data: Any, file: Path) -> None:
    try:
        model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "the file"
        more = f" (and {exc.error_count() - 1} more problem(s))" if exc.error_count() > 1 else ""
        fail(file, field, f"{first['msg'][0].lower()}{first['msg'][1:]}, found {first.get('input')!r:.80}{more}")


def _encoded(data: Any, field: str, file: Path) -> list[dict[str, Any]]:
    """Tensor references inside encoded ``data``, which must decode."""
    try:
        return check_encoded(data, field)
    except CheckpointError as exc:
        raise CheckpointError(f"{file}: {exc}; {HINT}") from None


def check_manifest(manifest: Any, file: Path) -> list[dict[str, Any]]:
    """Raise unless ``manifest`` (parsed ``shardwise.json``) is well formed; its tensor references otherwise."""
    _schema(_Manifest, manifest, file)
    names = manifest["params"].keys() | manifest["module"].keys()
    for alias, target in manifest["aliases"].items():
        if target not in names:
            fail(file, f"aliases.{alias}", f"names `{target:.80}`, which is neither a parameter nor a module entry")
    for key in manifest["state_dict_keys"]:
        if manifest["aliases"].get(key, key) not in names:
            fail(file, "state_dict_keys", f"lists `{key:.80}`, which has no entry in `params` or `module`")
    refs = []
    for part in ("client_state", "scheduler", "precision"):
        refs += _encoded(manifest.get(part), part, file)
    optimizer = manifest.get("optimizer")
    if optimizer is not None:
        groups = optimizer.get("param_groups")
        refs += _encoded(groups, "optimizer.param_groups", file)
        if groups is not None and not all(isinstance(g, dict) for g in groups):
            fail(file, "optimizer.param_groups", "must be a list of dicts (one per param group)")
        for name, entries in optimizer["state"].items():
            if name not in manifest["params"]:
                fail(file, f"optimizer.state.{name}", "is state of a name that is not a trainable parameter")
            for key, entry in entries.items():
                if entry["kind"] == "value" and _encoded(entry["value"], f"optimizer.state.{name}.{key}", file):
                    fail(file, f"optimizer.state.{name}.{key}", "is a plain value that holds tensors")
    for ref in refs:
        if not ref["__tensor__"].startswith("extra/"):
            fail(file, "tensor reference", f"`{ref['__tensor__']:.80}` is not an `extra/N` key")
    return refs


def check_rank_file(info: Any, rank: int, world_size: int, tensors: dict[str, Any], file: Path) -> None:
    """Raise unless ``info`` (parsed ``rankR.json``) is rank ``rank``'s, the tensors it refers to have
    those sizes in the index ``tensors``, and its RNG state can be set."""
    _schema(_RankFile, info, file)
    if info["rank"] != rank or info["world_size"] != world_size:
        fail(file, "rank", f"says rank {info['rank']} of {info['world_size']}, expected rank {rank} of {world_size}")
    rng = info.get("rng")
    if rng is None:
        return
    refs = _encoded(rng, "rng", file)
    for ref in refs:
        if not ref["__tensor__"].startswith(f"rng/{rank}/"):
            fail(file, "rng", f"refers to tensor `{ref['__tensor__']:.80}`, not one of rank {rank}'s")
    check_against_index({"params": {}, "module": {}}, refs, tensors, file)
    # Shapes are now bounded by the index; meta tensors stand in for the data, which is read later.
    meta = {r["__tensor__"]: torch.empty(r["shape"], dtype=TENSOR_DTYPES[r["dtype"]], device="meta") for r in refs}
    _check_rng(Decoder(meta).decode(rng, "rng"), file)


def _check_rng(state: Any, file: Path) -> None:
    """Set each RNG state on a scratch generator: what fails there would fail in ``restore_rng``."""
    known = {"python", "torch", "cuda", "numpy"}
    if not isinstance(state, dict) or not set(state) <= known or "python" not in state or "torch" not in state:
        fail(file, "rng", f"has parts {sorted(map(str, state)) if isinstance(state, dict) else state!r:.80}, expected python, torch[, cuda, numpy]")
    try:
        version, internal, gauss = state["python"]
        random.Random().setstate((version, tuple(internal), gauss))
    except (TypeError, ValueError, OverflowError) as exc:
        fail(file, "rng.python", f"is not a Python RNG state ({exc})")
    expected = torch.get_rng_state()
    got = state["torch"]
    if not isinstance(got, torch.Tensor) or got.dtype != expected.dtype or got.shape != expected.shape:
        found = f"{got.dtype}{list(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
        fail(file, "rng.torch", f"is {found}, expected a {expected.dtype} tensor of shape {list(expected.shape)}")
    cuda = state.get("cuda", [])
    if not isinstance(cuda, list) or not all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 for t in cuda):
        fail(file, "rng.cuda", "is not a list of uint8 vectors")
    if "numpy" in state:
        import numpy  # here: only a rank file holding numpy's RNG state needs numpy, an optional import

        try:
            numpy.random.RandomState().set_state(state["numpy"])
        except (TypeError, ValueError, OverflowError) as exc:
            fail(file, "rng.numpy", f"is not a numpy RNG state ({exc})")


def check_against_index(manifest: dict[str, Any], refs: list[dict[str, Any]], tensors: dict[str, Any], file: Path) -> None:
    """Every tensor the manifest describes has exactly that size (and dtype) in the index ``tensors``: the load
    allocates from these sizes, so this is what bounds its memory."""

    def expect(key: str, shape: list[int], dtype: Optional[str]) -> None:
        entry = tensors.get(key)
        if entry is None:
            if math.prod(shape) == 0:
                return  # an empty tensor has no chunk to save
            fail(file, key, f"is described with shape {shape} but the tensor index (`.metadata`) has no such entry")
        if list(entry.size) != list(shape):
            fail(file, key, f"has shape {list(shape)!s:.80} here but {list(entry.size)} in the tensor index")
        if dtype is not None and entry.properties.dtype != TENSOR_DTYPES[dtype]:
            fail(file, key, f"has dtype {dtype} here but {entry.properties.dtype} in the tensor index")

    for name, info in manifest["params"].items():
        expect(f"model/master/{name}", [math.prod(info["shape"])], None)
    for name, info in manifest["module"].items():
        expect(f"model/module/{name}", info["shape"], info["dtype"])
    optimizer = manifest.get("optimizer") or {"state": {}}
    for name, entries in optimizer["state"].items():
        numel = math.prod(manifest["params"][name]["shape"])
        for key, entry in entries.items():
            if entry["kind"] != "value":
                expect(f"optim/{name}/{key}", [numel] if entry["kind"] == "chunked" else entry["shape"], entry["dtype"])
    for ref in refs:
        key = ref["__tensor__"]  # `extra/3` is stored as `extra/extra/3` (its Stateful is named `extra`)
        expect(f"{key.split('/', 1)[0]}/{key}", ref["shape"], ref["dtype"])

_SHOWN = 12  # missing files listed in an error


def check_complete(path: Path) -> dict[str, Any]:
    """The manifest of the checkpoint in ``path``, checked against its index and files; raises naming every
    missing or short file, or the first field a checkpoint shardwise wrote could not hold."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist (tags in {path.parent}: {tags(path.parent)})")
    foreign = foreign_format(path)
    if foreign is not None:
        raise CheckpointError(foreign)
    has_index = regular_size(path / INDEX) is not None
    if has_index and regular_size(path / MANIFEST) is not None:  # checked before anything unpickles the index
        files.verify(path, INDEX, files.expected_digests(read_json(path / MANIFEST), path / MANIFEST))
    metadata = read_metadata(path) if has_index else None
    missing = _missing_files(path, metadata)
    if missing:
        hint = (
            "its save did not finish (a rank crashed or was killed while writing), so it was never committed"
            if path.name.startswith(TEMP_PREFIX) or MANIFEST in missing or INDEX in missing
            else "files were removed or truncated after it was written"
        )
        shown = missing[:_SHOWN] + ([f"... {len(missing) - _SHOWN} more"] if len(missing) > _SHOWN else [])
        raise CheckpointError(
            f"checkpoint {path} is incomplete: missing or truncated {shown}; {hint}. Load a complete "
            f"checkpoint instead (the one `{LATEST}` names, or another tag)"
        )
    assert metadata is not None  # `_missing_files` lists `.metadata` when there is none
    file = path / MANIFEST
    manifest = read_json(file)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("version"), int) \
            or manifest["version"] > VERSION:
        found = (manifest.get("format"), manifest.get("version")) if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(
            f"{file} is not a shardwise checkpoint manifest of version <= {VERSION} (format, version: {found!r:.100})"
        )
    refs = check_manifest(manifest, file)
    check_against_index(manifest, refs, metadata.state_dict_metadata, file)
    # every file a load may read has its checksum in the manifest (else none is checked)
    data = sorted(record_ends(metadata.storage_data, path / INDEX))
    ranks = [rank_file(r) for r in range(manifest["world_size"])]
    files.require_listed(path, [INDEX, *ranks, *data], files.expected_digests(manifest, file))
    return manifest


def read_rank_file(path: Path, rank: int, world_size: int, expected: dict[str, Any]) -> dict[str, Any]:
    """Rank ``rank``'s ``rankR.json`` in checkpoint ``path``, checked: its checksum (``expected``: the
    manifest's ``files``), its RNG state can be set, and every tensor it refers to has that size in the index."""
    files.verify(path, rank_file(rank), expected)
    file = path / rank_file(rank)
    info = read_json(file, files.MAX_RANK_FILE_BYTES)
    check_rank_file(info, rank, world_size, read_metadata(path).state_dict_metadata, file)
    return info


def _world_size(path: Path) -> Optional[int]:
    for candidate in [path / MANIFEST, *sorted(path.glob("rank*.json"))[:8]]:
        limit = files.MAX_RANK_FILE_BYTES if candidate.name != MANIFEST else files.MAX_MANIFEST_BYTES
        try:
            world = read_json(candidate, limit)
        except (FileNotFoundError, CheckpointError):
            continue
        value = world.get("world_size") if isinstance(world, dict) else None
        if type(value) is int and 1 <= value <= MAX_WORLD_SIZE:
            return value
    ranks = [int(m.group(1)) for f in path.glob("__*_*.distcp") if (m := re.fullmatch(r"__(\d{1,7})_\d+\.distcp", f.name))]
    ranks = [r for r in ranks if r < MAX_WORLD_SIZE]
    return max(ranks) + 1 if ranks else None


def _missing_files(path: Path, metadata: Any) -> list[str]:
    missing = [name for name in (MANIFEST, INDEX) if regular_size(path / name) is None]
    world = _world_size(path)
    if world is None:
        return missing + ["every rank's tensor file (none was started)"]
    for r in range(world):
        # `rankR.json` is written right after rank R's tensor file is flushed: without it, that file is cut short
        if regular_size(path / rank_file(r)) is None:
            missing += [f"__{r}_0.distcp (rank {r} did not finish writing it)", rank_file(r)]
    if metadata is None:
        return missing
    for name, size in sorted(record_ends(metadata.storage_data, path / INDEX).items()):
        actual = regular_size(path / name)
        if actual is None or actual < size:
            missing.append(name)
    return missing


# ------------------------------------------------------------ decoded values

def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    return "a number or null" if value is None or _is_number(value) else f"a {type(value).__name__}"


def conform(loaded: Any, template: Any, where: str) -> Any:
    """``loaded`` if it has the structure of ``template``; else a :class:`CheckpointError` naming ``where``.

    An integer stays an integer; a float or None may be any number or None; dicts may omit keys, never add any;
    sequences match element by element when the lengths agree, else every element matches the first.
    """
    if isinstance(template, dict):
        if not isinstance(loaded, dict):
            _refuse(where, "a mapping", _kind(loaded))
        unknown = [k for k in loaded if k not in template]
        if unknown:
            _refuse(where, f"only the keys {sorted(map(str, template))}", f"unknown key(s) {sorted(map(str, unknown))}")
        return {k: conform(v, template[k], f"{where}[{k!r}]") for k, v in loaded.items()}
    if isinstance(template, (list, tuple)):
        if not isinstance(loaded, (list, tuple)):
            _refuse(where, f"a {type(template).__name__}", _kind(loaded))
        templates = template if len(loaded) == len(template) else [template[0] if template else None] * len(loaded)
        return type(loaded)(conform(v, t, f"{where}[{i}]") for i, (v, t) in enumerate(zip(loaded, templates)))
    if isinstance(template, torch.Tensor):
        ok = isinstance(loaded, torch.Tensor) and loaded.dtype == template.dtype and loaded.shape == template.shape
        if not ok:
            got = f"{loaded.dtype} {tuple(loaded.shape)}" if isinstance(loaded, torch.Tensor) else _kind(loaded)
            _refuse(where, f"a {template.dtype} tensor of shape {tuple(template.shape)}", got)
        return loaded
    if isinstance(template, int) and not isinstance(template, bool):
        if isinstance(loaded, bool) or not isinstance(loaded, int):
            _refuse(where, "an integer", _kind(loaded))
        return loaded
    if template is None or isinstance(template, float):
        if loaded is not None and not _is_number(loaded):
            _refuse(where, "a number or null", _kind(loaded))
        return loaded
    if type(loaded) is not type(template):
        _refuse(where, _kind(template), _kind(loaded))
    return loaded


def _refuse(where: str, expected: str, got: str) -> NoReturn:
    raise CheckpointError(
        f"`{where}` in the checkpoint is {got}, but this engine's value there is {expected}; the checkpoint "
        "was damaged or crafted, or written by another program: refusing it (nothing was changed)"
    )
