"""``engine.save_pretrained(dir)``: a folder Hugging Face's ``from_pretrained`` loads, from any ZeRO stage.

The full fp32 weights are gathered to rank 0 (:meth:`Engine.full_state_dict`, collective), then rank 0 writes the
folder's files into a temporary folder next to ``dir``, moved in only when all are complete (what each file holds, and
why ``module.save_pretrained`` cannot do this at stage 3: docs/trainer.md, "Hugging Face export").
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from .export import save_state_dict

__all__ = ["export_pretrained", "save_pretrained"]

WEIGHTS_NAME = "model.safetensors"


def save_pretrained(engine: Any, save_dir: str | os.PathLike[str]) -> str:
    """Write ``save_dir`` (collective: every rank calls it; rank 0 writes); returns its path on every rank."""
    state = engine.full_state_dict()  # every rank joins the gather; {} outside rank 0
    target = Path(save_dir)
    error: BaseException | None = None
    if engine.comm.rank == 0:
        try:
            _write_folder(state, target, lambda folder: _write_configs(engine.module, folder))
        except Exception as caught:  # told to every rank first: none may return while another still waits
            error = caught
    failed = engine.comm.broadcast_object(error is not None, src=0)
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(
            f"rank {engine.comm.rank}: `save_pretrained` failed on rank 0 (its traceback says why) and wrote "
            f"nothing to {target}: fix that and call `engine.save_pretrained(dir)` again on every rank")
    return str(target)


def export_pretrained(ckpt_dir: str | os.PathLike[str], save_dir: str | os.PathLike[str], *, tag: str | None = None,
                      engine: str | None = None, config: str | os.PathLike[str] | None = None) -> list[Path]:
    """``shardwise checkpoint export --hf``: a saved checkpoint as a folder ``from_pretrained`` loads, in this
    process (no process group; where the config files come from: docs/trainer.md, "Hugging Face export").  Returns
    the config files copied (none: ``from_pretrained`` will need one)."""
    from ..checkpoint.consolidation import consolidated_state_dict  # here: it imports DCP (~1.4 s)

    state = consolidated_state_dict(ckpt_dir, tag, engine)
    sources = _config_sources(Path(ckpt_dir), Path(config) if config is not None else None)

    def copy_configs(folder: Path) -> None:
        for name, source in sources.items():
            shutil.copyfile(source, folder / name)

    _write_folder(state, Path(save_dir), copy_configs)
    return list(sources.values())


def _config_sources(ckpt_dir: Path, config: Path | None) -> dict[str, Path]:
    """Output name -> file: what ``config`` names, else a Hugging Face config found beside the checkpoint."""
    if config is not None:
        if config.is_file():
            return {"config.json": config}
        found = {name: config / name for name in ("config.json", "generation_config.json") if (config / name).is_file()}
        if "config.json" not in found:
            raise FileNotFoundError(f"--config {config}: no config.json there; pass the model's Hugging Face "
                                    "config.json or the folder holding it")
        return found
    for folder in (ckpt_dir, ckpt_dir.parent):
        candidate = folder / "config.json"
        if candidate.is_file() and _is_hf_config(candidate):  # not a training config of the same name
            found = {"config.json": candidate}
            if (folder / "generation_config.json").is_file():
                found["generation_config.json"] = folder / "generation_config.json"
            return found
    return {}


def _is_hf_config(path: Path) -> bool:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "model_type" in data


def _write_folder(state: dict[str, torch.Tensor], target: Path, write_configs: Callable[[Path], None]) -> None:
    """``model.safetensors`` and the configs, staged beside ``target`` and moved in only once all are written."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        save_state_dict(state, staging / WEIGHTS_NAME)
        write_configs(staging)
        target.mkdir(exist_ok=True)
        for child in staging.iterdir():
            os.replace(child, target / child.name)  # each file whole; all are complete before the first moves
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_configs(module: Any, folder: Path) -> None:
    config: Any = getattr(module, "config", None)
    if hasattr(config, "architectures"):
        config.architectures = [type(module).__name__]  # as Hugging Face's own save_pretrained records it
    for attribute, name in (("config", "config.json"), ("generation_config", "generation_config.json")):
        config = getattr(module, attribute, None)
        if callable(getattr(config, "to_json_string", None)):
            (folder / name).write_text(_json(config), encoding="utf-8")


def _json(config: Any) -> str:
    try:
        return str(config.to_json_string(use_diff=False))
    except TypeError:  # a config class whose to_json_string takes no arguments
        return str(config.to_json_string())
