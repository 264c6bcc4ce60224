"""Rebuilding a model from a ``model.json`` without running code that the data chose.

A ``model.json`` describes how to build the model a checkpoint holds, in one of two forms::

    {"module": "pkg.mod:GPT", "config_class": "GPTConfig", "config": {...}, "tokenizer": "bytes"}
    {"source": "gpt.py",      "class": "GPT", "config_class": "GPTConfig", "config": {...}, "tokenizer": "bytes"}

``source`` (a Python file) is imported only with ``trust_source`` (``shardwise generate --trust-model-source``, as
Hugging Face's ``trust_remote_code``).  Where a ``model.json`` is looked for and what it can and cannot make shardwise
run: docs/checkpoints.md, "Threat model".
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.machinery
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

from torch import nn

__all__ = ["SPEC_NAME", "TRUST_FLAG", "ModelSpecError", "UntrustedSourceError", "build_model", "find_model_spec"]

SPEC_NAME = "model.json"
TRUST_FLAG = "--trust-model-source"
_LATEST = "latest"  # a folder holding it is a `checkpoint_dir`
_TAG_MARKERS = ("shardwise.json", "engines.json")  # a folder holding one is one checkpoint (a tag directory)
_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_MODULE = re.compile(rf"(?P<module>{_NAME}(?:\.{_NAME})*):(?P<cls>{_NAME})")


class ModelSpecError(ValueError):
    """No usable ``model.json`` for a checkpoint."""


class UntrustedSourceError(ModelSpecError):
    """A ``model.json`` names a Python file to run, and the user has not allowed it."""


def _search_folders(checkpoint: Path) -> list[Path]:
    """The checkpoint's own directory, then its run directory (the parent of the ``checkpoint_dir``)."""
    if not checkpoint.is_dir():  # a consolidated file: its folder, and the run directory if that is a checkpoint_dir
        folder = checkpoint.parent
        return [folder, folder.parent] if (folder / _LATEST).is_file() else [folder]
    if any((checkpoint / name).is_file() for name in _TAG_MARKERS):  # a tag directory
        return [checkpoint, checkpoint.parent, checkpoint.parent.parent]
    return [checkpoint, checkpoint.parent]


def find_model_spec(checkpoint: Path) -> Path:
    """The ``model.json`` in ``checkpoint``'s directory or in its run directory (nowhere else)."""
    folders = _search_folders(checkpoint)
    for folder in folders:
        if (folder / SPEC_NAME).is_file():
            return folder / SPEC_NAME
    raise ModelSpecError(
        f"no `{SPEC_NAME}` in {' or '.join(str(f) for f in folders)} (the checkpoint's directory and its run "
        "directory, the only places looked in), so the model cannot be rebuilt; `examples/train_gpt.py` writes "
        "one in its run directory: pass `--model-json PATH` to name it"
    )


def build_model(spec: Any, where: Path, checkpoint: Path, trust_source: bool = False) -> nn.Module:
    """The model ``spec`` (the parsed ``model.json`` at ``where``) describes; see the module docstring."""
    if not isinstance(spec, dict):
        raise ModelSpecError(f"{where} holds a {type(spec).__name__}, expected a JSON object")
    if ("module" in spec) == ("source" in spec):
        raise ModelSpecError(f"{where} must name the model by exactly one of `module` (\"pkg.mod:Class\", an "
                             "installed module) or `source` (a Python file, with `class`)")
    if "config" not in spec:
        raise ModelSpecError(f"{where} lacks `config`, the model's constructor arguments")
    if spec.get("tokenizer", "bytes") != "bytes":
        raise ModelSpecError(f"{where} has tokenizer `{spec['tokenizer']}`; only byte-level models (`bytes`) "
                             "are supported")
    if "module" in spec:
        module, class_name = _installed_module(spec["module"], where)
        return _construct(module, class_name, spec, where)
    return _construct(_trusted_source(spec, where, checkpoint, trust_source), spec.get("class"), spec, where)


def _installed_module(name: Any, where: Path) -> tuple[ModuleType, str]:
    match = _MODULE.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        raise ModelSpecError(f"{where}: `module` is {name!r:.80}, expected \"pkg.mod:Class\" "
                             "(dotted module, colon, class)")
    module = match["module"]
    installed = _installed_origin(module.partition(".")[0])
    found = importlib.util.find_spec(module.partition(".")[0])
    if installed is None or found is None or found.origin != installed:
        raise ModelSpecError(
            f"{where}: `module` names `{module}`, which is not installed (it would come from "
            f"{getattr(found, 'origin', None) or 'nowhere'}); a model.json may name only a module importable from "
            "`sys.path` outside the current directory: `pip install` its package, or name the file as `source` and "
            f"pass `{TRUST_FLAG}`"
        )
    return importlib.import_module(module), match["cls"]


def _installed_origin(top: str) -> Optional[str]:
    """Where ``top`` is installed, not counting the current directory (``python -m`` puts it on ``sys.path``)."""
    here = Path.cwd().resolve()
    path = [p for p in sys.path if p not in ("", ".") and Path(p).resolve() != here]
    spec = importlib.machinery.PathFinder.find_spec(top, path)
    return None if spec is None else spec.origin


def _trusted_source(spec: dict[str, Any], where: Path, checkpoint: Path, trust_source: bool) -> ModuleType:
    if not isinstance(spec["source"], str):
        raise ModelSpecError(f"{where}: `source` is {spec['source']!r:.80}, expected a path to a Python file")
    source = (where.parent / spec["source"]).resolve()  # a relative source belongs to its model.json, not to the cwd
    if not source.is_file():
        raise ModelSpecError(f"the model source {source} named in {where} does not exist; fix its `source` entry")
    if not trust_source:
        raise UntrustedSourceError(
            f"{where} names the Python file {source} as the model's source; importing it runs it with your "
            "permissions, so shardwise does not do that on the word of a file it found. Read it, and if you trust "
            f"it run `shardwise generate {checkpoint} {TRUST_FLAG}` (in Python: "
            "`load_model(..., trust_source=True)`), or name an installed module in its place: "
            "`\"module\": \"pkg.mod:Class\"`"
        )
    return _import_file(source)


def _import_file(source: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_shardwise_model_{source.stem}", source)
    if spec is None or spec.loader is None:
        raise ModelSpecError(f"cannot import {source}; `source` in `{SPEC_NAME}` must be a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def _construct(module: ModuleType, class_name: Any, spec: dict[str, Any], where: Path) -> nn.Module:
    model_class = getattr(module, class_name, None) if isinstance(class_name, str) else None
    if not (isinstance(model_class, type) and issubclass(model_class, nn.Module)):
        raise ModelSpecError(f"{where}: `{class_name}` in {module.__name__} is not an `nn.Module` subclass; "
                             "name the model's class")
    config = spec["config"]
    if not isinstance(config, dict):
        raise ModelSpecError(f"{where}: `config` is a {type(config).__name__}, expected a JSON object")
    if not spec.get("config_class"):
        return model_class(**config)
    config_class = getattr(module, spec["config_class"], None) if isinstance(spec["config_class"], str) else None
    if not (isinstance(config_class, type) and dataclasses.is_dataclass(config_class)):
        raise ModelSpecError(f"{where}: `config_class` {spec['config_class']!r:.80} in {module.__name__} is not a "
                             "dataclass; name the model's config dataclass, or leave it out to pass `config` as "
                             "keyword arguments")
    return model_class(config_class(**config))
