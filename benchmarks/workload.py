"""The model and data every system trains: ``examples/gpt.py`` on a synthetic token stream.

The data is a seeded first-order Markov chain over 256 tokens in which each
token has 4 possible successors, so the loss can fall from ln 256 ≈ 5.5
towards ln 4 ≈ 1.4: the model has something real to learn, no file is read
and every machine generates the same stream.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from .configs import Workload

__all__ = ["batch", "build_model", "gpt_module", "model_numel", "model_tensors", "seq_len", "synthetic_stream"]

_EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
_VOCAB = 256
_BRANCHING = 4
_STREAM_TOKENS = 1 << 16
# Keeps (seed, step) pairs apart when folded into one generator seed.
_STEP_STRIDE = 1 << 32


def gpt_module() -> ModuleType:
    """``examples/gpt.py``, imported by putting ``examples/`` on ``sys.path``."""
    if str(_EXAMPLES) not in sys.path:
        sys.path.insert(0, str(_EXAMPLES))
    import gpt

    return gpt


def build_model(workload: Workload) -> nn.Module:
    """The GPT preset ``workload.size``, initialised from ``workload.seed``."""
    gpt = gpt_module()
    torch.manual_seed(workload.seed)
    return gpt.GPT(gpt.gpt_config(workload.size))


def _meta_model(size: str, **overrides: int) -> nn.Module:
    """The preset ``size`` (with ``overrides`` of its config) on the meta device (shapes only, no memory)."""
    gpt = gpt_module()
    with torch.device("meta"):
        return gpt.GPT(gpt.gpt_config(size, **overrides))


def _meta_parameters(size: str, **overrides: int) -> list[torch.nn.Parameter]:
    """The distinct parameters of the preset ``size`` (with ``overrides`` of its config), on the meta
    device."""
    return list(_meta_model(size, **overrides).parameters())


def model_numel(size: str, **overrides: int) -> int:
    """Distinct parameters of the preset ``size`` (Ψ in ZeRO's formulas)."""
    return sum(p.numel() for p in _meta_parameters(size, **overrides))


def model_tensors(size: str, **overrides: int) -> int:
    """Distinct parameter tensors of the preset ``size``."""
    return len(_meta_parameters(size, **overrides))


def model_units(size: str, threshold: int = 10_000, **overrides: int) -> int:
    """Units stage 3 gathers for the preset ``size``, formed as the engine forms them: modules whose direct
    parameters hold more than ``threshold`` elements (``stage3_param_persistence_threshold``; smaller ones
    stay gathered)."""
    from shardwise.zero.stage3.strategy import unit_specs

    return sum(not persistent for _, _, persistent in unit_specs(_meta_model(size, **overrides), threshold))


def seq_len(workload: Workload) -> int:
    """Tokens per sequence: ``workload.seq_len`` or the model's ``block_size``."""
    return workload.seq_len or gpt_module().gpt_config(workload.size).block_size


def synthetic_stream(seed: int, length: int = _STREAM_TOKENS) -> torch.Tensor:
    """A deterministic token stream from a sparse random Markov chain (1-D ``long``)."""
    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(_VOCAB, (_VOCAB, _BRANCHING), generator=gen).tolist()
    choices = torch.randint(_BRANCHING, (length,), generator=gen).tolist()
    tokens = [0] * length
    for i in range(1, length):
        tokens[i] = successors[tokens[i - 1]][choices[i]]
    return torch.tensor(tokens, dtype=torch.long)


def batch(
    stream: torch.Tensor, workload: Workload, rank: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``(x, y)`` for ``step``: its slice of one global draw of windows.

    The draw depends only on ``(seed, step)``, so every system sees the same
    global batch at every step, and ``y`` is ``x`` shifted by one token.
    """
    t = seq_len(workload)
    gen = torch.Generator().manual_seed(workload.seed * _STEP_STRIDE + step)
    starts = torch.randint(stream.numel() - t - 1, (workload.world_size * workload.micro_batch,), generator=gen)
    mine = starts[rank * workload.micro_batch : (rank + 1) * workload.micro_batch]
    windows = torch.stack([stream[s : s + t + 1] for s in mine.tolist()])
    return windows[:, :-1], windows[:, 1:]
