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

``generate`` keeps a KV cache: each new token runs one position through the
blocks, attending to the keys and values kept from earlier ones, instead of
the whole prefix again (``use_cache=False`` recomputes, as before).
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


class KVCache:
    """Keys and values of the positions seen so far, one ``(k, v)`` per block, each (b, n_head, t, head_dim)."""

    def __init__(self) -> None:
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def length(self) -> int:
        """Positions held (0 when empty)."""
        return next(iter(self.layers.values()))[0].size(2) if self.layers else 0

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's ``k``/``v`` for ``layer``; returns all of them, old then new."""
        if layer in self.layers:
            old_k, old_v = self.layers[layer]
            k, v = torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2)
        self.layers[layer] = (k, v)
        return k, v


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where a position sees only earlier ones."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        # bias=False: a key bias has a true gradient of zero (see module doc).
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, *, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (b, t, c) -> (b, n_head, t, head_dim) for the fused attention kernel.
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            # The new positions come after every cached one: each sees all of the cache and the new
            # positions up to itself (a causal mask shifted right by the cached length).
            k, v = cache.extend(layer, k, v)
            seen = torch.ones(t, k.size(2), dtype=torch.bool, device=x.device).tril(k.size(2) - t)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=seen, dropout_p=p)
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

    def forward(self, x: torch.Tensor, *, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cache=cache, layer=layer)
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
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, cache: KVCache | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return ``(logits, loss)``; ``loss`` is None when ``targets`` is None.

        With ``cache``, ``idx`` continues the positions the cache holds (and is added to it).
        """
        start = cache.length if cache is not None else 0
        t = idx.size(1)
        if start + t > self.config.block_size:
            raise ValueError(
                f"sequence length {start + t} exceeds `block_size` {self.config.block_size}; "
                "crop the input or build the model with a larger `block_size`."
            )
        pos = torch.arange(start, start + t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for i, block in enumerate(self.blocks):
            x = block(x, cache=cache, layer=i)
        x = self.ln_f(x)
        # The tied head reads the embedding's weight from the parent on purpose.
        logits = F.linear(x, self.wte.weight) if self.head is None else self.head(x)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.0, use_cache: bool = True
    ) -> torch.Tensor:
        """Extend ``idx`` (b, t) by ``max_new_tokens`` tokens.

        Greedy when ``temperature == 0``; otherwise samples from the softmax at
        that temperature (seed ``torch`` for reproducible samples).  With the
        KV cache each token costs one position's forward; once the text fills
        ``block_size``, the cache restarts from the last half of it (positions
        are absolute, so a window cannot slide under a cache).  Without it,
        every token recomputes the last ``block_size`` positions.
        """
        block = self.config.block_size
        cache: KVCache | None = None
        fresh = idx[:, -block:]  # what the next forward reads: a whole context, or the one new token
        for _ in range(max_new_tokens):
            if not use_cache:
                fresh = idx[:, -block:]
            elif cache is None or cache.length + fresh.size(1) > block:
                # A new cache: the first context, or, once the text fills block_size, its last half.
                fresh = idx[:, -block:] if cache is None else idx[:, -(block // 2):]
                cache = KVCache()
            logits, _ = self(fresh, cache=cache)
            nxt = _pick(logits[:, -1, :], temperature)
            idx = torch.cat([idx, nxt], dim=1)
            fresh = nxt
        return idx


def _pick(last: torch.Tensor, temperature: float) -> torch.Tensor:
    """The next token from the last position's logits: greedy at 0, else sampled at ``temperature``."""
    if temperature == 0.0:
        return last.argmax(dim=-1, keepdim=True)
    return torch.multinomial(F.softmax(last / temperature, dim=-1), num_samples=1)


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
