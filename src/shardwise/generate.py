"""``shardwise generate``: sample text from a trained byte-level language model, in one CPU process.

The weights come from a sharded checkpoint (a ``checkpoint_dir`` or one tag
directory in it: put together here with no process group) or from a
consolidated file (``shardwise checkpoint consolidate``).  The model is rebuilt
from ``model.json``, which ``examples/train_gpt.py`` writes into its run
directory and which is looked up next to the checkpoint and in the folders
above it::

    {"source": "/path/to/gpt.py", "class": "GPT", "config_class": "GPTConfig",
     "config": {...}, "tokenizer": "bytes"}

The model must have ``generate(idx, max_new_tokens, temperature)``, as the
example GPT does; tokens are UTF-8 bytes.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

__all__ = ["ModelSpecError", "find_model_spec", "generate_text", "load_model"]

SPEC_NAME = "model.json"
_LEVELS = 3  # the checkpoint, its folder, and two above: a run directory holds checkpoints/TAG/


class ModelSpecError(ValueError):
    """No usable ``model.json`` for a checkpoint."""


def find_model_spec(checkpoint: Path) -> Path:
    """The ``model.json`` nearest to ``checkpoint`` (in it, or up to three folders above)."""
    start = checkpoint if checkpoint.is_dir() else checkpoint.parent
    for folder in [start, *start.parents][: _LEVELS + 1]:
        if (folder / SPEC_NAME).is_file():
            return folder / SPEC_NAME
    raise ModelSpecError(
        f"no `{SPEC_NAME}` in {start} or the {_LEVELS} folders above it, so the model cannot be rebuilt; "
        "`examples/train_gpt.py` writes one in its run directory: pass `--model-json PATH` to name it"
    )


def _import(source: Path) -> Any:
    if not source.is_file():
        raise ModelSpecError(f"the model source {source} named in `{SPEC_NAME}` does not exist; fix its `source` entry")
    spec = importlib.util.spec_from_file_location(f"_shardwise_model_{source.stem}", source)
    if spec is None or spec.loader is None:
        raise ModelSpecError(f"cannot import {source}; `source` in `{SPEC_NAME}` must be a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def _build(spec: dict[str, Any], where: Path) -> nn.Module:
    missing = [key for key in ("source", "class", "config") if key not in spec]
    if missing:
        raise ModelSpecError(f"{where} lacks {missing}; it needs `source`, `class` and `config`")
    if spec.get("tokenizer", "bytes") != "bytes":
        raise ModelSpecError(f"{where} has tokenizer `{spec['tokenizer']}`; only byte-level models (`bytes`) are supported")
    module = _import(Path(spec["source"]))
    model_class = getattr(module, spec["class"])
    config = spec["config"]
    if spec.get("config_class"):
        return model_class(getattr(module, spec["config_class"])(**config))
    return model_class(**config)


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from .checkpoint import consolidated_state_dict, load_consolidated

    return consolidated_state_dict(checkpoint) if checkpoint.is_dir() else load_consolidated(checkpoint)


def load_model(checkpoint: Any, model_json: Optional[Any] = None) -> nn.Module:
    """The model saved in ``checkpoint`` (sharded directory or consolidated file), in eval mode."""
    checkpoint = Path(checkpoint)
    if not checkpoint.exists():
        raise FileNotFoundError(f"checkpoint {checkpoint} does not exist; pass a `checkpoint_dir`, a tag directory, "
                                "or a file written by `shardwise checkpoint consolidate`")
    where = Path(model_json) if model_json is not None else find_model_spec(checkpoint)
    model = _build(json.loads(where.read_text(encoding="utf-8")), where)
    model.load_state_dict(_weights(checkpoint))
    return model.eval()


def generate_text(model: nn.Module, prompt: str, tokens: int, temperature: float = 0.8, seed: int = 0) -> str:
    """``prompt`` continued by ``tokens`` bytes sampled from ``model`` (greedy when ``temperature`` is 0)."""
    torch.manual_seed(seed)
    ids = torch.tensor([list(prompt.encode("utf-8"))], dtype=torch.long)
    out = model.generate(ids, max_new_tokens=tokens, temperature=temperature)  # type: ignore[operator]
    return bytes(out[0].to(torch.uint8).tolist()).decode("utf-8", errors="replace")
