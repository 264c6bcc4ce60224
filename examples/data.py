"""Byte-level text data that needs no download.

By default the text is this Python's own standard library source (``*.py``
files next to ``os.py``), sorted by name and concatenated up to a byte budget:
real, varied text that exists on every machine with Python. ``--data FILE``
in ``train_gpt.py`` takes the user's text instead.

Tokens are bytes (vocab 256), so there is no tokenizer to ship.

:class:`TextWindows` is the text as a map-style dataset (what
``shardwise.Trainer`` shards and shuffles); :func:`batches` draws random
windows by step, for loops written by hand.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

DEFAULT_MAX_BYTES = 2_000_000
# torch's CPU generator keeps only 32 bits of a seed, so (seed, step) is folded
# into 32 bits: seed * stride + step, with the stride a prime above a million,
# keeps every (seed, step) pair apart for small seeds and runs of under a
# million steps.
_STEP_STRIDE = 1_000_003
_SEED_BITS = (1 << 32) - 1


def stdlib_text(max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """The standard library's top-level ``.py`` files, sorted, up to ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        chunk = path.read_bytes()[: max_bytes - total]
        chunks.append(chunk)
        total += len(chunk)
        if total >= max_bytes:
            break
    if total == 0:
        raise FileNotFoundError(
            f"no `*.py` files under the standard library at {root}; pass a text file with `--data FILE`."
        )
    return b"".join(chunks)


def load_bytes(path: str | Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    """Text as a 1-D ``uint8`` tensor: ``path``'s bytes, or the stdlib source when None."""
    raw = stdlib_text(max_bytes) if path is None else Path(path).read_bytes()[:max_bytes]
    # bytearray: frombuffer needs a writable buffer to avoid a warning.
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a 1-D ``long`` tensor of token ids."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens: torch.Tensor) -> str:
    """Token ids back to text; invalid UTF-8 (a split character) becomes U+FFFD."""
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def batches(
    data: torch.Tensor,
    batch_size: int,
    block_size: int,
    *,
    rank: int,
    world_size: int,
    seed: int,
    step: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``(x, y)`` batch for ``step``, each ``(batch_size, block_size)`` long.

    One generator seeded by ``(seed, step)`` draws offsets for the whole world
    (``batch_size * world_size`` windows) and each rank takes its own slice.
    So ranks get different windows, a step's batch never depends on what ran
    before it (resumable), and the world's union of batches is what one
    process with the global batch size would draw: same data, any world size.
    ``y`` is ``x`` shifted one byte ahead.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"`rank` {rank} is outside [0, world_size={world_size}).")
    if data.numel() <= block_size:
        raise ValueError(
            f"the text has {data.numel()} bytes, fewer than `block_size` + 1 = {block_size + 1}; "
            "use a longer text or a smaller model."
        )
    gen = torch.Generator().manual_seed((seed * _STEP_STRIDE + step) & _SEED_BITS)
    starts = torch.randint(data.numel() - block_size, (world_size * batch_size,), generator=gen)
    mine = starts[rank * batch_size : (rank + 1) * batch_size]
    # (batch, block+1) windows; x is all but the last byte, y all but the first.
    windows = torch.stack([data[s : s + block_size + 1] for s in mine.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]


class TextWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The text as consecutive ``(x, y)`` windows of ``block_size`` bytes; ``y`` is ``x`` one byte ahead.

    Item ``i`` starts at byte ``i * block_size``, so the windows tile the text
    without overlap and every byte is a target once per epoch.
    """

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        if data.numel() <= block_size:
            raise ValueError(
                f"the text has {data.numel()} bytes, fewer than `block_size` + 1 = {block_size + 1}; "
                "use a longer text or a smaller model."
            )
        self.data = data
        self.block_size = block_size

    def __len__(self) -> int:
        return (self.data.numel() - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} is outside [0, {len(self)})")
        start = index * self.block_size
        window = self.data[start : start + self.block_size + 1].long()
        return window[:-1], window[1:]


def split_text(data: torch.Tensor, held_out: float = 0.05, max_held_out: int = 65_536) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, held-out)``: the held-out part is the text's last ``held_out`` fraction (at most ``max_held_out`` bytes)."""
    if not 0.0 < held_out < 1.0:
        raise ValueError(f"`held_out` is {held_out}; expected a fraction between 0 and 1, e.g. 0.05")
    size = min(int(data.numel() * held_out), max_held_out)
    return data[: data.numel() - size], data[data.numel() - size :]
