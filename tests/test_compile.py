"""torch.compile at every stage on 2 gloo ranks: compiled training equals eager training.

Each case trains the same model eagerly and compiled (backend ``aot_eager``:
forward and backward graphs, no code generation, fast on CPU) and compares the
full parameters after 4 steps (tolerance 1e-6; both sides run the same
kernels).  The graphs a forward runs through are counted with a counting
backend: after warm-up no step compiles anything new, and docs/stage3.md
quotes the counts printed here.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _parity import adamw, assert_close_params, batch, full_params_everywhere
from torch import nn

import shardwise
from shardwise.testing import distributed_test, run_subtests
from shardwise.zero.stage3.hooks import EXTERNAL_ATTR

STEPS = 4


class Block(nn.Module):
    """A residual block with a user-written forward (what per-block compile compiles)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.scale = nn.Parameter(torch.ones(dim))
        self.gate = nn.Linear(dim, dim)  # its forward never runs: read through F.linear

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(F.linear(h, self.gate.weight, self.gate.bias))
        return h + torch.tanh(self.fc(h)) * self.scale * gate


class Net(nn.Module):
    """Embedding, two blocks, a head, and ``side``: a child whose forward never runs (read via ``F.linear``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList([Block(16) for _ in range(2)])
        self.head = nn.Linear(16, 8)
        self.side = nn.Linear(16, 8)

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx).mean(dim=1)
        for block in self.blocks:
            h = block(h)
        out = self.head(h) + F.linear(h, self.side.weight, self.side.bias)
        return F.mse_loss(out, target)


class GraphCounter:
    """A torch.compile backend: ``aot_eager``, counting the graphs run."""

    def __init__(self) -> None:
        self.runs = 0

    def __call__(self, gm: torch.fx.GraphModule, inputs: list[Any]) -> Callable[..., Any]:
        from torch._dynamo.backends.registry import lookup_backend

        compiled = lookup_backend("aot_eager")(gm, inputs)

        def run(*args: Any) -> Any:
            self.runs += 1
            return compiled(*args)

        return run


def _train(stage: int, how: str) -> tuple[dict[str, torch.Tensor], list[tuple[int, int]], Any]:
    """Train ``Net`` for STEPS steps compiled ``how``; the parameters, (graphs run, graphs compiled) per step."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    torch.manual_seed(0)
    net = Net()
    model: nn.Module = net
    backend = GraphCounter()
    if how == "whole":
        model = torch.compile(net, backend=backend)
    elif how == "block":
        for block in net.blocks:
            block.compile(backend=backend)
    config = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine = shardwise.initialize(model, adamw(model.parameters()), config)
    if how == "engine":
        assert not engine.is_compiled
        engine.compile(backend=backend, compile_kwargs={"dynamic": False})
        assert engine.is_compiled
    graphs = []
    for step in range(STEPS):
        counters.clear()
        before = backend.runs
        loss = engine(*batch(step, dist.get_rank()))
        engine.backward(loss)
        engine.step()
        graphs.append((backend.runs - before, int(counters["stats"]["unique_graphs"])))
    params = full_params_everywhere(engine)
    external = [id(p) for block in net.blocks for p in block.__dict__.get(EXTERNAL_ATTR, ())]
    engine.destroy()
    return {name.replace("_orig_mod.", ""): p for name, p in params.items()}, graphs, (external, net)


@distributed_test(world_size=2, timeout=240)
def test_compiled_training_matches_eager() -> None:
    def case(stage: int, how: str) -> None:
        want, _, _ = _train(stage, "eager")
        got, graphs, (external, net) = _train(stage, how)
        assert_close_params(got, want, atol=1e-6)
        if how != "block" or stage == 3:  # (at stages 0-2 a block's graph is not counted in runs: see docs)
            assert graphs[0][0] > 0, f"stage {stage} {how}: nothing ran compiled ({graphs})"
        # Warm after step 1 (stages 1-2 compile once more for the first forward after a step): nothing new.
        assert all(new == 0 for _, new in graphs[2:]), f"stage {stage} {how}: recompiled after warm-up {graphs}"
        assert graphs[2][0] == graphs[3][0], f"stage {stage} {how}: graph count changes per step {graphs}"
        if stage == 3:
            # a block's compiled forward reads `gate.weight` without calling `gate`: registered at trace time
            gates = [id(block.gate.weight) for block in net.blocks]
            assert all(g in external for g in gates), f"stage 3 {how}: `gate.weight` not registered as external"
        if dist.get_rank() == 0:
            print(f"stage {stage} {how}: (graphs run, graphs compiled) per step {graphs}")

    run_subtests(case, [
        {"stage": 3, "how": "whole"},
        {"stage": 3, "how": "block"},
        {"stage": 3, "how": "engine"},
        {"stage": 0, "how": "whole"},
        {"stage": 1, "how": "block"},
        {"stage": 2, "how": "engine"},
    ])
    run_subtests(_refusals, [{}])


def _refusals() -> None:
    """What shardwise lacks is refused by name: DeepCompile schedules and compiled autograd."""
    torch.manual_seed(0)
    model = Net()
    engine = shardwise.initialize(model, adamw(model.parameters()), {"zero_optimization": {"stage": 3}})
    for kwargs, words in (({"schedule": [(0, "x")]}, "DeepCompile"),
                          ({"compiled_autograd_enabled": True}, "compiled_autograd_enabled")):
        try:
            engine.compile(backend="eager", **kwargs)
        except ValueError as error:
            assert words in str(error) and "rank" in str(error), str(error)
        else:
            raise AssertionError(f"engine.compile({kwargs}) was accepted")
        assert not engine.is_compiled
    engine.destroy()
