"""Training FLOPs of a step, and a card's dense bf16 peak: what a TFLOPS figure and a % of peak are made of.

FLOPs per token are PaLM's (Chowdhery et al. 2022, appendix B): 6·N for the
weights (N every distinct parameter, a tied head counted once: the head's
matrix product is real work, the lookups it shares a weight with are not)
plus 12·L·T·d for the attention scores and their use (L layers, T tokens per
sequence, width d), counted over the full T×T square although the mask is
causal, as PaLM counts it.  A step's FLOPs are that times its tokens.

Peaks are the dense (no sparsity) bf16 tensor-core figures of NVIDIA's data
sheets, found by the name torch reports; a card not listed gets no % of peak.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = ["FLOPS_FORMULA", "bf16_peak", "step_flops"]

FLOPS_FORMULA = "6·N + 12·L·T·d FLOPs per token (PaLM, appendix B; N all parameters, attention not halved for the mask)"

# (words that must all appear in torch.cuda.get_device_name(), lower case) -> dense bf16 TFLOP/s.
# More specific names first: "H100 PCIe" before "H100".
_PEAKS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("h200", "nvl"), 835.5),   # H200 NVL data sheet: 1,671 TFLOPS with sparsity
    (("h200",), 989.4),         # H200 SXM data sheet: 1,979 with sparsity (the H100 SXM's compute)
    (("h100", "pcie"), 756.5),  # H100 PCIe data sheet: 1,513 with sparsity
    (("h100", "nvl"), 835.5),   # H100 NVL data sheet: 1,671 with sparsity
    (("h100",), 989.4),         # H100 SXM data sheet ("NVIDIA H100 80GB HBM3"): 1,979 with sparsity
    (("a100",), 312.0),         # A100 data sheet, SXM and PCIe alike: 624 with sparsity
)


def bf16_peak(device_name: str) -> Optional[float]:
    """The card's dense bf16 peak in TFLOP/s, or None when ``device_name`` is not in the table."""
    name = device_name.lower()
    for words, peak in _PEAKS:
        if all(word in name for word in words):
            return peak
    return None


def step_flops(size: str, overrides: dict[str, int], micro_batch: int, seq_len: int) -> float:
    """Training FLOPs of one step of the GPT preset ``size`` on ``micro_batch`` sequences of ``seq_len``."""
    from .model import gpt_preset

    model = gpt_preset(size, **overrides)
    if seq_len:
        model = dataclasses.replace(model, seq=seq_len)
    return model.flops_per_token() * micro_batch * model.seq
