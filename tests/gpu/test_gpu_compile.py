"""``torch.compile`` with inductor (the default backend) at stages 0-3: compiled training follows eager.

Inductor fuses and reorders reductions, so it is not bit-exact: after 3 fp32
steps the losses agree to 1e-4 relative, the weights on average to 1e-6, and
no weight is further than one Adam step (lr) from eager's (a weight whose
gradient is float noise can take a full-lr step either way, see DESIGN.md).
GPU only: on the CPU, inductor builds C++ for a minute per case, and
tests/test_compile.py covers the CPU with ``aot_eager``.
"""

from __future__ import annotations

import _gpu
import pytest
import torch
from torch._dynamo.utils import counters

import shardwise

STEPS = 3


@pytest.mark.parametrize("device", _gpu.CUDA_ONLY)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_inductor_compiled_training_follows_eager(device: str, stage: int) -> None:
    where = _gpu.one_rank(device)
    eager = _gpu.engine(stage, "fp32")
    want_losses = _gpu.train(eager, 0, STEPS, where)
    want = _gpu.masters(eager)
    eager.destroy()
    torch._dynamo.reset()
    counters.clear()
    model = torch.compile(_gpu.gpt(0))
    engine = shardwise.initialize(model, _gpu.adamw(model.parameters()), _gpu.config(stage, "fp32"))
    losses = _gpu.train(engine, 0, STEPS, where)
    got = {k.replace("_orig_mod.", ""): v for k, v in _gpu.masters(engine).items()}
    engine.destroy()
    assert counters["stats"]["unique_graphs"] > 0, f"stage {stage}: nothing was compiled"
    assert losses == pytest.approx(want_losses, rel=1e-4)
    diff, name = _gpu.max_diff(got, want)
    assert diff <= _gpu.LR, f"stage {stage}: {name} is {diff:.3g} from eager, more than one step"
    mean = sum((got[k] - want[k]).abs().sum().item() for k in want) / sum(v.numel() for v in want.values())
    assert mean <= 1e-6, f"stage {stage}: weights differ from eager by {mean:.3g} on average"
