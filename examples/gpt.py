"""A small GPT in plain PyTorch.

This file imports nothing distributed and nothing from shardwise: parallelism
is applied to the model from the outside (see ``train_gpt.py``), the way
torchtitan keeps ``model.py`` apart from ``parallelize.py``.

Two details are deliberate, because the engine's tests lean on them:

* With ``tie_weights`` the output head has no weight of its own: ``GPT.forward``
  reads ``self.wte.weight`` through ``F.linear``. A ZeRO stage 3 engine must
  still see the full embedding there ("a parent reading a child's weight").
* No parameter has a true gradient of zero. A key bias in attention would
  (softmax is invariant to adding the same score to every key), and Adam turns
  the float noise in such a gradient into a full-lr update, hiding real
  agreement in parity tests. So the qkv projection has ``bias=False``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    """Shape of a :class:`GPT`. ``vocab_size=256`` means byte-level text."""

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    tie_weights: bool = True

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"`n_embd` ({self.n_embd}) must be divisible by `n_head` "
                f"({self.n_head}); pick an `n_head` that divides it."
            )


# Presets: name -> shape. Sizes are the count of distinct parameters with the
# head tied (checked by tests/test_gpt_model.py).
_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(block_size=64, n_layer=2, n_head=2, n_embd=64),  # ~0.12M
    "small": dict(block_size=128, n_layer=5, n_head=4, n_embd=128),  # ~1.0M
    "10m": dict(block_size=256, n_layer=6, n_head=6, n_embd=384),  # ~10.8M
    "40m": dict(block_size=256, n_layer=12, n_head=8, n_embd=512),  # ~38M
}


def gpt_config(size: str, **overrides: object) -> GPTConfig:
    """Return the preset :class:`GPTConfig` named ``size``, with ``overrides``."""
    if size not in _PRESETS:
        raise ValueError(f"unknown GPT size {size!r}; expected one of {sorted(_PRESETS)}")
    fields: dict[str, object] = {**_PRESETS[size], **overrides}
    return GPTConfig(**fields)  # type: ignore[arg-type]


def preset_names() -> list[str]:
    """Names accepted by :func:`gpt_config`, smallest first."""
    return list(_PRESETS)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where a position sees only earlier ones."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        # bias=False: a key bias has a true gradient of zero (see module doc).
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (b, t, c) -> (b, n_head, t, head_dim) for the fused attention kernel.
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    """The position-wise feed-forward layer, 4x wide."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """A pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def init_gpt_weights(module: nn.Module, n_layer: int) -> None:
    """GPT-2 init of ``module``'s parameters (what :class:`GPT` applies to itself)."""
    for name, p in module.named_parameters():
        if p.dim() < 2:
            # LayerNorm weights stay 1, biases 0 (the module defaults).
            if name.endswith("bias"):
                nn.init.zeros_(p)
            continue
        std = 0.02
        # Residual projections are scaled down so the residual stream's
        # variance does not grow with depth.
        if name.endswith("proj.weight"):
            std = 0.02 / math.sqrt(2 * n_layer)
        nn.init.normal_(p, mean=0.0, std=std)


class GPT(nn.Module):
    """A decoder-only transformer language model."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        # Tied: no head module at all, forward reads self.wte.weight directly.
        self.head: nn.Linear | None = None
        if not cfg.tie_weights:
            self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2 init; deterministic given ``torch.manual_seed``."""
        init_gpt_weights(self, self.config.n_layer)

    def num_parameters(self) -> int:
        """Distinct parameters (a tied head counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return ``(logits, loss)``; ``loss`` is None when ``targets`` is None."""
        t = idx.size(1)
        if t > self.config.block_size:
            raise ValueError(
                f"sequence length {t} exceeds `block_size` {self.config.block_size}; "
                "crop the input or build the model with a larger `block_size`."
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        # The tied head reads the embedding's weight from the parent on purpose.
        logits = F.linear(x, self.wte.weight) if self.head is None else self.head(x)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.0
    ) -> torch.Tensor:
        """Extend ``idx`` (b, t) by ``max_new_tokens`` tokens, one forward each.

        Greedy when ``temperature == 0``; otherwise samples from the softmax at
        that temperature (seed ``torch`` for reproducible samples).
        """
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size :]
            logits, _ = self(context)
            last = logits[:, -1, :]
            if temperature == 0.0:
                nxt = last.argmax(dim=-1, keepdim=True)
            else:
                probs = F.softmax(last / temperature, dim=-1)
                nxt = torch.multinomial(probs, num_samples=1)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


# ---------------------------------------------------------------------------
# The same GPT as a list of layers, each taking the previous one's output
# (``train_gpt_pipe.py`` turns them into a pipeline): token embedding →
# position embedding → blocks → final LayerNorm → head reusing the token
# embedding's weight.  Each layer is GPT-2 initialised on construction.


class TokenEmbedding(nn.Embedding):
    """``wte`` as a layer of its own: token ids (b, t) -> (b, t, n_embd)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg.vocab_size, cfg.n_embd)
        nn.init.normal_(self.weight, mean=0.0, std=0.02)


class PositionEmbedding(nn.Module):
    """Adds ``wpe`` (and dropout) to token embeddings (b, t, n_embd)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.block_size = cfg.block_size
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        nn.init.normal_(self.wpe.weight, mean=0.0, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(1)
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds `block_size` {self.block_size}; crop the input.")
        return self.drop(x + self.wpe(torch.arange(t, device=x.device)))


class GPTBlock(Block):
    """A :class:`Block` GPT-2 initialised on construction, as :class:`GPT` initialises its blocks."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        init_gpt_weights(self, cfg.n_layer)


def lm_head(embedding: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    """The tied output head: logits from the token embedding's weight."""
    return F.linear(x, embedding.weight)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-byte cross-entropy over every position (in fp32, whatever the compute dtype)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
