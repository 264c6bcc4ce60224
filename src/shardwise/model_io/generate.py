"""``shardwise generate``: sample text from a trained byte-level language model, in one CPU process.

The weights come from a sharded checkpoint (a ``checkpoint_dir`` or one tag directory in it, put together here
with no process group) or a consolidated file; the model is rebuilt from ``model.json``
(:mod:`.model_spec`), which ``examples/train_gpt.py`` writes into its run directory.  The model must have
``generate(idx, max_new_tokens, temperature)``, as the example GPT does; tokens are UTF-8 bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from .model_spec import ModelSpecError, UntrustedSourceError, build_model, find_model_spec

__all__ = ["ModelSpecError", "UntrustedSourceError", "find_model_spec", "generate_text", "load_model"]


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from ..checkpoint import consolidated_state_dict, load_consolidated  # here: consolidation imports DCP (~1.4 s)

    return consolidated_state_dict(checkpoint) if checkpoint.is_dir() else load_consolidated(checkpoint)


def _read_spec(where: Path) -> Any:
    try:
        return json.loads(where.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelSpecError(f"cannot read {where}: {type(exc).__name__}: {exc}; it must be a JSON object") from exc


def load_model(checkpoint: Any, model_json: Optional[Any] = None, trust_source: bool = False) -> nn.Module:
    """The model saved in ``checkpoint`` (sharded directory or consolidated file), in eval mode.

    ``trust_source`` allows running the Python file a ``model.json`` names as ``source``; without it such a
    model is refused with :class:`UntrustedSourceError` (a ``module`` that is installed needs no trust).
    """
    checkpoint = Path(checkpoint)
    if not checkpoint.exists():
        raise FileNotFoundError(f"checkpoint {checkpoint} does not exist; pass a `checkpoint_dir`, a tag directory, "
                                "or a file written by `shardwise checkpoint consolidate`")
    where = Path(model_json) if model_json is not None else find_model_spec(checkpoint)
    model = build_model(_read_spec(where), where, checkpoint, trust_source)
    model.load_state_dict(_weights(checkpoint))
    return model.eval()


def generate_text(model: nn.Module, prompt: str, tokens: int, temperature: float = 0.8, seed: int = 0) -> str:
    """``prompt`` continued by ``tokens`` bytes sampled from ``model`` (greedy when ``temperature`` is 0)."""
    torch.manual_seed(seed)
    ids = torch.tensor([list(prompt.encode("utf-8"))], dtype=torch.long)
    out = model.generate(ids, max_new_tokens=tokens, temperature=temperature)  # type: ignore[operator]
    return bytes(out[0].to(torch.uint8).tolist()).decode("utf-8", errors="replace")
