"""A script's write to the parameters between steps reaches the masters on the device too (bf16, one rank).

``model.load_state_dict(...)`` on the engine's module after a step (stages 0-2), or ``zero.load_state_dict`` (stage 3):
the written parameter's masters take the values written (as bf16 holds them at stages 0-2, exactly at stage 3) and
keep them through a step at lr 0; every other master keeps its exact fp32 value.  With the optimizer (and at stage 3
the parameters) offloaded, the masters live in host memory or a file while the values written are on the card, so
this also checks the copies between them.
"""

from __future__ import annotations

import _gpu
import pytest
import torch

import shardwise

CASES = [pytest.param(stage, variant, id=f"s{stage}-{variant}", marks=[pytest.mark.offload] if _gpu.offloads(variant) else [])
         for stage, variant in [(0, "in-memory"), (1, "in-memory"), (2, "in-memory"), (3, "in-memory"),
                                (2, "offload-cpu"), (3, "offload-param-cpu"), (3, "offload-param-nvme")]]
WRITTEN = "blocks.0.mlp.fc.weight"


@pytest.mark.parametrize("device", _gpu.DEVICES)
@pytest.mark.parametrize("stage, variant", CASES)
def test_a_write_between_steps_reaches_the_masters(device: str, stage: int, variant: str) -> None:
    where = _gpu.one_rank(device)
    engine = _gpu.engine(stage, "bf16", variant)
    _gpu.train(engine, 0, 1, where)
    before = _gpu.masters(engine)
    value = torch.randn(before[WRITTEN].shape, generator=torch.Generator().manual_seed(3))
    if stage == 3:
        shardwise.zero.load_state_dict(engine.module, {WRITTEN: value}, strict=False)
    else:
        engine.module.load_state_dict({WRITTEN: value.to(where)}, strict=False)
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.0  # the step changes nothing: only the write shows
    _gpu.train(engine, 1, 1, where)
    after = _gpu.masters(engine)
    want = value if stage == 3 else value.to(torch.bfloat16).float()
    assert torch.equal(after[WRITTEN], want), f"stage {stage} {variant} on {device}: the write missed the masters"
    for name, master in before.items():
        if name != WRITTEN:
            assert torch.equal(after[name], master), f"{name}: a master not written changed"
    engine.destroy()
    if device == "cuda":
        torch.cuda.synchronize()
