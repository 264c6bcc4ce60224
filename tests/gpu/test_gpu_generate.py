"""``engine.generate`` at stage 3 (every weight sharded) equals the unsharded model's, token for token.

A Hugging Face GPT-2 built from a local tiny config (no hub), trained 2 steps
at stage 3 in fp32, then greedy ``generate`` through the engine (its hooks
gather each block's weights as the KV-cached loop reaches it) against the
same weights in a plain model.
"""

from __future__ import annotations

from typing import Any

import _gpu
import pytest
import torch

import shardwise


def _gpt2(seed: int) -> Any:
    import transformers  # in the `test` extras and on the device image: a missing install fails, it does not skip

    config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("device", _gpu.DEVICES)
def test_gpt2_generate_at_stage3_equals_the_unsharded_model(device: str) -> None:
    where = _gpu.one_rank(device)
    model = _gpt2(0)
    config = {"train_micro_batch_size_per_gpu": 2,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine = shardwise.initialize(model, _gpu.adamw(model.parameters()), config)
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        ids = torch.randint(0, 96, (2, 12), generator=gen).to(where)
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
    prompt = torch.randint(0, 96, (2, 4), generator=gen).to(where)
    generated = engine.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert generated.device.type == where.type and generated.shape == (2, 12)
    plain = _gpt2(1)
    missing, unexpected = plain.load_state_dict(engine.full_state_dict(), strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # the head is tied
    plain.to(where).eval()
    assert torch.equal(generated, plain.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0))
    engine.destroy()
