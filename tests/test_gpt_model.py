"""The example GPT (examples/gpt.py) and its byte-level data (examples/data.py), in one process."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str) -> ModuleType:
    """Import an example file under a private name, leaving sys.path alone."""
    spec = importlib.util.spec_from_file_location(f"_examples_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while it executes
    spec.loader.exec_module(module)
    return module


gpt = _load("gpt")
data = _load("data")


def _tiny(seed: int = 0, **overrides: object) -> Any:
    torch.manual_seed(seed)
    return gpt.GPT(gpt.gpt_config("tiny", **overrides))


# ---------------------------------------------------------------------- model

@pytest.mark.parametrize(
    ("size", "low", "high"),
    [("tiny", 0.08e6, 0.15e6), ("small", 0.8e6, 1.3e6), ("10m", 8e6, 12e6), ("40m", 35e6, 45e6)],
)
def test_preset_parameter_counts(size: str, low: float, high: float) -> None:
    model = gpt.GPT(gpt.gpt_config(size))
    assert low <= model.num_parameters() <= high


def test_unknown_size_names_the_choices() -> None:
    with pytest.raises(ValueError, match="tiny"):
        gpt.gpt_config("huge")


def test_tied_head_reads_the_embedding() -> None:
    model = _tiny()
    assert model.head is None
    assert not any("head" in name for name, _ in model.named_parameters())
    untied = gpt.GPT(gpt.gpt_config("tiny", tie_weights=False))
    cfg = model.config
    assert untied.num_parameters() - model.num_parameters() == cfg.vocab_size * cfg.n_embd

    # The logits are exactly the final hidden state times the embedding matrix.
    hidden: list[torch.Tensor] = []
    model.ln_f.register_forward_hook(lambda _m, _i, out: hidden.append(out))
    idx = torch.randint(0, cfg.vocab_size, (2, 10))
    logits, loss = model(idx)
    assert loss is None
    torch.testing.assert_close(logits, F.linear(hidden[0], model.wte.weight))


def test_tied_embedding_gets_the_head_gradient() -> None:
    model = _tiny()
    idx = torch.randint(0, 256, (2, 8))
    _, loss = model(idx, idx)
    loss.backward()
    # Bytes never seen as input still get a gradient: only through the tied head.
    unseen = sorted(set(range(256)) - set(idx.flatten().tolist()))
    assert model.wte.weight.grad[unseen].abs().sum() > 0


def test_no_parameter_has_a_zero_gradient() -> None:
    model = _tiny()
    x = torch.randint(0, 256, (4, 32))
    _, loss = model(x, torch.roll(x, -1, dims=1))
    loss.backward()
    dead = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().max() == 0]
    assert dead == []


def test_init_is_deterministic_and_loss_starts_near_uniform() -> None:
    a, b = _tiny(seed=3), _tiny(seed=3)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.wte.weight, _tiny(seed=4).wte.weight)
    x, y = torch.randint(0, 256, (2, 4, 32))
    _, loss = a(x, y)
    assert abs(loss.item() - math.log(256)) < 0.3


def test_forward_rejects_too_long_input() -> None:
    model = _tiny()
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, model.config.block_size + 1, dtype=torch.long))


def test_generate_greedy_is_deterministic_and_crops_to_block_size() -> None:
    model = _tiny().eval()
    prompt = torch.tensor([[100, 101, 102, 32]])
    # More new tokens than block_size: the context must be cropped along the way.
    n = model.config.block_size + 6
    first = model.generate(prompt, n)
    assert first.shape == (1, prompt.size(1) + n)
    assert torch.equal(first[:, : prompt.size(1)], prompt)
    assert torch.equal(first, model.generate(prompt, n))
    assert not first.requires_grad


def test_generate_sampling_follows_the_seed() -> None:
    model = _tiny().eval()
    prompt = torch.zeros(2, 3, dtype=torch.long)
    torch.manual_seed(7)
    a = model.generate(prompt, 12, temperature=1.0)
    torch.manual_seed(7)
    b = model.generate(prompt, 12, temperature=1.0)
    assert a.shape == (2, 15) and torch.equal(a, b)


def test_a_plain_torch_loop_learns_the_stdlib_text() -> None:
    model = _tiny()
    text = data.load_bytes(max_bytes=200_000)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(40):
        x, y = data.batches(text, 16, 64, rank=0, world_size=1, seed=0, step=step)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 5.0 and sum(losses[-5:]) / 5 < 3.6


# ----------------------------------------------------------------------- data

def test_stdlib_text_is_real_python_within_the_budget() -> None:
    text = data.stdlib_text(max_bytes=50_000)
    assert len(text) == 50_000
    assert b"def " in text and b"import " in text
    assert data.stdlib_text(max_bytes=50_000) == text


def test_load_bytes_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_text("héllo world\n" * 10, encoding="utf-8")
    tokens = data.load_bytes(path)
    assert tokens.dtype == torch.uint8 and tokens.numel() == path.stat().st_size
    assert data.decode(tokens) == path.read_text(encoding="utf-8")
    assert data.load_bytes(path, max_bytes=5).numel() == 5


def test_encode_decode_round_trip() -> None:
    text = "print('π ≈ 3.14')\n"
    assert data.decode(data.encode(text)) == text


def test_batches_are_shifted_by_one_and_deterministic() -> None:
    text = data.load_bytes(max_bytes=100_000)
    x, y = data.batches(text, 4, 32, rank=0, world_size=1, seed=0, step=5)
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, y2 = data.batches(text, 4, 32, rank=0, world_size=1, seed=0, step=5)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    x3, _ = data.batches(text, 4, 32, rank=0, world_size=1, seed=0, step=6)
    x4, _ = data.batches(text, 4, 32, rank=0, world_size=1, seed=1, step=5)
    assert not torch.equal(x, x3) and not torch.equal(x, x4)


def test_batches_differ_per_rank_and_cover_the_one_process_batch() -> None:
    text = data.load_bytes(max_bytes=100_000)
    per_rank = [data.batches(text, 4, 32, rank=r, world_size=2, seed=0, step=3)[0] for r in range(2)]
    assert not torch.equal(per_rank[0], per_rank[1])
    # Two ranks of 4 see exactly what one process with a batch of 8 sees.
    whole, _ = data.batches(text, 8, 32, rank=0, world_size=1, seed=0, step=3)
    assert torch.equal(torch.cat(per_rank), whole)


def test_batches_reject_bad_arguments() -> None:
    text = data.load_bytes(max_bytes=1000)
    with pytest.raises(ValueError, match="rank"):
        data.batches(text, 2, 8, rank=2, world_size=2, seed=0, step=0)
    with pytest.raises(ValueError, match="block_size"):
        data.batches(text[:8], 2, 8, rank=0, world_size=1, seed=0, step=0)
