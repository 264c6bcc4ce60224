"""``engine.save_pretrained(dir)``: a folder Hugging Face's ``from_pretrained`` loads, from any ZeRO stage.

The full fp32 weights are gathered to rank 0 (:meth:`Engine.full_state_dict`,
collective), then rank 0 writes ``model.safetensors`` (tied weights once, as
Hugging Face stores them) and, when the model has a ``config`` with
``to_json_string`` (a ``PretrainedConfig``), ``config.json``, plus
``generation_config.json`` when it has one.  The files are written into a
temporary folder next to ``dir`` and moved in only when all are complete: a
failed gather or write leaves ``dir`` as it was.  ``module.save_pretrained``
itself cannot do this at stage 3: it reads the module's parameters, which are
empty shards there.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from .export import save_state_dict

__all__ = ["save_pretrained"]

WEIGHTS_NAME = "model.safetensors"


def save_pretrained(engine: Any, save_dir: str | os.PathLike[str]) -> str:
    """Write ``save_dir`` (collective: every rank calls it; rank 0 writes); returns its path on every rank."""
    state = engine.full_state_dict()  # every rank joins the gather; {} outside rank 0
    target = Path(save_dir)
    error: BaseException | None = None
    if engine.comm.rank == 0:
        try:
            _write(engine.module, state, target)
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


def _write(module: Any, state: dict[str, torch.Tensor], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        save_state_dict(state, staging / WEIGHTS_NAME)
        _write_configs(module, staging)
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
