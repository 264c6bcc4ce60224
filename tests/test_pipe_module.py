"""PipelineModule on one process: specs, ties, partitioning, the schedule, ``to_sequential()``."""

from __future__ import annotations

import functools
import itertools
from typing import Any, Sequence

import pytest
import torch
import torch.nn.functional as F
from _pipe_models import DIM, VOCAB, Scale, cross_entropy, micro_batch, pipeline, pool, tied_layers
from torch import nn

import shardwise
from shardwise.pipe import LayerSpec, PipelineModule, PipelineSequential, TiedLayerSpec
from shardwise.pipe.p2p import _decode, _encode
from shardwise.pipe.partition import balanced, partition, uniform
from shardwise.pipe.schedule import Action, Phase, forward_only, one_f_one_b

# ------------------------------------------------------------------ to_sequential


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_to_sequential_equals_its_layers() -> None:
    """Outputs and gradients equal running the same modules by hand; the tied weight is one Parameter
    whose gradient sums both uses."""
    source = pipeline(tied_layers(depth=2))
    model = source.to_sequential()
    assert isinstance(model, PipelineSequential) and not isinstance(model, PipelineModule)
    x, y = micro_batch(0)

    embed, lin1, lin2 = source.tied_modules["embed"], source.get_submodule("2"), source.get_submodule("4")
    by_hand = F.linear(torch.tanh(lin2(torch.tanh(lin1(embed(x).mean(1))))), embed.weight)
    torch.testing.assert_close(model(x), by_hand, rtol=0, atol=0)
    cross_entropy(by_hand, y).backward()
    want = _grads(source)
    source.zero_grad()
    model(x, y).backward()
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, want[name], rtol=0, atol=0, msg=name)

    # one Parameter per tied key: the count is the distinct parameters
    distinct = VOCAB * DIM + 2 * (DIM * DIM + DIM)
    assert sum(p.numel() for p in model.parameters()) == distinct
    assert [n for n, _ in model.named_parameters()] == ["tied_modules.embed.weight", "2.weight", "2.bias", "4.weight", "4.bias"]
    assert model.state_dict().keys() == source.state_dict().keys()


def test_any_callable_is_a_layer() -> None:
    """Functions, lambdas, bound methods, partials and modules; forward_fns built in a loop stay
    bound to their own module (no late-binding closure)."""
    scale = Scale()
    layers: list[Any] = [
        LayerSpec(nn.Embedding, VOCAB, DIM),
        pool,  # function
        lambda x: x + 1.0,  # lambda
        scale.forward,  # bound method of a module that is not itself a layer
        functools.partial(torch.clamp, min=-3.0, max=3.0),  # partial
        nn.Tanh(),  # module instance
    ]
    # Three tied keys built in a loop: each forward_fn must see its own key's module.
    for key in ("a", "b", "c"):
        layers.append(TiedLayerSpec(key, nn.Linear, DIM, DIM, forward_fn=lambda m, x: m(x) * 0.5))
    model = PipelineModule(layers, seed_layers=True).to_sequential()
    x = torch.randint(0, VOCAB, (3, 4))
    hidden = torch.clamp(scale(model.get_submodule("0")(x).mean(1) + 1.0), -3, 3).tanh()
    for key in ("a", "b", "c"):
        hidden = model.tied_modules[key](hidden) * 0.5
    torch.testing.assert_close(model(x), hidden, rtol=0, atol=0)


def test_activation_checkpointing_recomputes_in_backward() -> None:
    """Same outputs and gradients with and without checkpointing; checkpointed layers run again in
    backward, and not at all again under no_grad."""
    calls = {"n": 0}

    def counted(x: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return x

    layers = tied_layers(depth=2)
    layers.insert(2, counted)  # first in its chunk: recomputation stops once it has what backward needs
    plain = pipeline(layers).to_sequential()
    checkpointed = pipeline(layers, activation_checkpoint_interval=2).to_sequential()
    x, y = micro_batch(1)
    plain(x, y).backward()
    calls["n"] = 0
    loss = checkpointed(x, y)
    assert calls["n"] == 1
    loss.backward()
    assert calls["n"] == 2, "the checkpointed chunk was not recomputed in backward"
    want = _grads(plain)
    for name, grad in _grads(checkpointed).items():
        torch.testing.assert_close(grad, want[name], msg=name)
    with torch.no_grad():
        calls["n"] = 0
        checkpointed(x, y)
    assert calls["n"] == 1


def test_custom_checkpoint_func_and_tuple_activations() -> None:
    used = []

    def my_checkpoint(fn: Any, *args: Any) -> Any:
        used.append(len(args))
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)

    layers = [lambda x: (x, x * 2.0), lambda p: (p[0] + p[1], p[1]), lambda p: p[0] * p[1]]
    model = PipelineModule(layers, activation_checkpoint_interval=1, activation_checkpoint_func=my_checkpoint)
    x = torch.ones(2, requires_grad=True)
    model(x).sum().backward()
    assert used == [1, 2, 2]  # a tuple activation is passed unpacked, as DeepSpeed's checkpoint wants
    torch.testing.assert_close(x.grad, torch.full((2,), 12.0))  # d(3x · 2x)/dx


def test_seed_layers_builds_each_layer_alike_anywhere() -> None:
    torch.manual_seed(0)
    a = pipeline(tied_layers()).state_dict()
    torch.manual_seed(99)
    before = torch.rand(1)
    torch.manual_seed(99)
    b = pipeline(tied_layers()).state_dict()
    assert torch.rand(1) == before, "building moved the caller's random stream"
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)


def test_one_stage_module_trains_through_initialize() -> None:
    """num_stages=1 (or a lone process asking for more) is an ordinary module and engine."""
    model = pipeline(tied_layers(), num_stages=2)  # one process: every layer on one stage
    assert model.num_stages == 1 and len(list(model.parameters())) == 9
    engine = shardwise.initialize(model, config={"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    assert type(engine) is shardwise.Engine
    x, y = micro_batch(0)
    first = engine(x, y).item()
    for _ in range(5):
        engine.backward(engine(x, y))
        engine.step()
    assert engine(x, y).item() < first
    with pytest.raises(RuntimeError, match=r"not a pipeline engine.*engine\(inputs, labels\)"):
        engine.train_batch(iter([(x, y)]))
    with pytest.raises(RuntimeError, match="eval_batch.*not a pipeline engine"):
        engine.eval_batch(iter([(x, y)]))
    engine.destroy()


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        ([TiedLayerSpec("emb", nn.Embedding, 8, 4), TiedLayerSpec("emb", nn.Linear, 4, 8)],
         r"key `emb`: layer 0 builds `Embedding` but layer 1 builds `Linear`"),
        ([TiedLayerSpec("emb", nn.Embedding, 8, 4), TiedLayerSpec("emb", nn.Embedding, 8, 5)],
         r"key `emb`: layer 0 builds tied weights of shapes \{'weight': \(8, 4\)\} but layer 1 of \{'weight': \(8, 5\)\}"),
        ([TiedLayerSpec("emb", nn.Embedding, 8, 4, tied_weight_attr="bias")], r"`emb`.*has no parameter `bias`"),
        ([3], "layer 0 is a `int`"),
        ([], "`layers` is empty"),
    ],
    ids=["classes", "shapes", "attr", "not-callable", "empty"],
)
def test_bad_layers(layers: list[Any], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        PipelineModule(layers)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="key 'a.b' must be a non-empty string without `.`"):
        TiedLayerSpec("a.b", nn.Linear, 2, 2)
    with pytest.raises(ValueError, match="activation_checkpoint_interval=-1"):
        PipelineModule([nn.Tanh()], activation_checkpoint_interval=-1)
    with pytest.raises(ValueError, match="num_stages=0"):
        PipelineModule([nn.Tanh()], num_stages=0)
    with pytest.raises(TypeError, match="built a `int`, not an `nn.Module`"):
        PipelineModule([LayerSpec(lambda: 3)])
    with pytest.raises(ValueError, match="only the last stage|no `loss_fn`"):
        PipelineModule([nn.Linear(2, 2)])(torch.ones(1, 2), torch.ones(1, 2))


# ------------------------------------------------------------------ partitioning


def test_partition_methods() -> None:
    names = ["Embedding", "function", "Block", "Block", "Block", "Block", "LayerNorm", "function"]
    sizes = [1000, 0, 100, 100, 100, 100, 10, 0]
    weigh = sizes.__getitem__
    assert partition(names, weigh, 2, "uniform") == [0, 4, 8]
    assert partition(names, weigh, 3, "uniform") == [0, 3, 6, 8]
    assert partition(names, weigh, 2, "type:block") == [0, 4, 8]  # 2 blocks each, case-insensitive
    assert partition(names, weigh, 4, "type:^Block$") == [0, 3, 4, 5, 8]
    assert partition(names, weigh, 2, "parameters") == [0, 2, 8]  # the embedding alone outweighs the rest
    assert partition(names, weigh, 2, [0, 5, 8]) == [0, 5, 8]


def test_balanced_is_optimal_and_spreads_weightless_layers() -> None:
    assert balanced([5, 1, 1, 1, 1, 1, 5], 3) == [0, 1, 6, 7]
    assert balanced([0, 0, 0, 0, 0, 0], 3) == [0, 2, 4, 6]
    assert balanced([1, 0, 0, 0, 1], 2) == [0, 3, 5]
    assert uniform(7, 3) == [0, 3, 5, 7]
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):  # against brute force over every cut
        weights = torch.randint(0, 9, (7,), generator=gen).tolist()
        best = min(max(sum(weights[a:b]) for a, b in zip(c, c[1:])) for c in _all_cuts(7, 3))
        cut = balanced(weights, 3)
        assert len(cut) == 4 and all(a < b for a, b in zip(cut, cut[1:]))
        assert max(sum(weights[a:b]) for a, b in zip(cut, cut[1:])) == best, (weights, cut)


def _all_cuts(count: int, parts: int) -> list[list[int]]:
    return [[0, *inner, count] for inner in itertools.combinations(range(1, count), parts - 1)]


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ("balanced", "unknown partition_method `balanced`; expected `parameters`, `uniform`, `type:REGEX`"),
        (7, "unknown partition_method 7"),
        ("type:Conv", r"`type:Conv` matches no layer; the layers' class names are \['Block'"),
        ("type:(", "not a valid regular expression"),
        ([0, 2, 2], r"\[0, 2, 2\] is not a valid list of boundaries: expected 3 increasing integers from 0 to 4"),
        ([0, 4], "expected 3 increasing integers"),
    ],
)
def test_bad_partition_method(method: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        partition(["Block"] * 4, lambda i: 1, 2, method)


def test_fewer_layers_than_stages() -> None:
    with pytest.raises(ValueError, match=r"2 layer\(s\) cannot fill 3 pipeline stages"):
        partition(["A", "B"], lambda i: 1, 3, "uniform")


# ------------------------------------------------------------------ the schedule


def simulate(schedules: Sequence[Sequence[Action]], forward: float = 1.0, backward: float = 1.0) -> list[tuple[float, float]]:
    """Replay per-stage schedules with fixed action times; ``(busy, makespan)`` per stage.

    A forward waits for the previous stage's forward of the same micro-batch,
    a backward for the next stage's backward of it; transfers take no time.
    Raises if the schedules deadlock (an action waits on one never run).
    """
    stages = len(schedules)
    done: dict[tuple[int, Phase, int], float] = {}
    clock = [0.0] * stages
    position = [0] * stages
    while any(position[s] < len(schedules[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while position[s] < len(schedules[s]):
                action = schedules[s][position[s]]
                ready = _ready_at(done, s, stages, action)
                if ready is None:
                    break
                cost = forward if action.phase is Phase.FORWARD else backward
                clock[s] = max(clock[s], ready) + cost
                done[(s, action.phase, action.micro_batch)] = clock[s]
                position[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: str(schedules[s][position[s]]) for s in range(stages) if position[s] < len(schedules[s])}
            raise RuntimeError(f"the schedules deadlock: stages wait forever at {stuck}")
    makespan = max(clock)
    return [(sum(forward if a.phase is Phase.FORWARD else backward for a in schedules[s]), makespan) for s in range(stages)]


def _ready_at(done: dict[tuple[int, Phase, int], float], stage: int, stages: int, action: Action) -> float | None:
    """When the input of ``action`` is available (None: not yet produced)."""
    if action.phase is Phase.FORWARD:
        source = (stage - 1, Phase.FORWARD, action.micro_batch) if stage > 0 else None
    else:
        source = (stage + 1, Phase.BACKWARD, action.micro_batch) if stage < stages - 1 else (stage, Phase.FORWARD, action.micro_batch)
    if source is None:
        return 0.0
    return done.get(source)


@pytest.mark.parametrize(("stages", "micro"), [(2, 1), (2, 4), (3, 2), (4, 8), (4, 3)])
def test_one_f_one_b(stages: int, micro: int) -> None:
    schedules = [one_f_one_b(s, stages, micro) for s in range(stages)]
    for stage, actions in enumerate(schedules):
        forwards = [a.micro_batch for a in actions if a.phase is Phase.FORWARD]
        backwards = [a.micro_batch for a in actions if a.phase is Phase.BACKWARD]
        assert forwards == backwards == list(range(micro))
        in_flight = peak = 0
        for action in actions:  # activations held: at most stages - stage
            in_flight += 1 if action.phase is Phase.FORWARD else -1
            peak = max(peak, in_flight)
        assert peak == min(stages - stage, micro)
    if (stages, micro) == (2, 4):
        assert " ".join(map(str, schedules[0])) == "F0 F1 B0 F2 B1 F3 B2 B3"
        assert " ".join(map(str, schedules[1])) == "F0 B0 F1 B1 F2 B2 F3 B3"
    # equal stage costs: the idle share is the textbook bubble, whatever backward costs against forward
    for backward in (1.0, 2.0):
        for busy, makespan in simulate(schedules, forward=1.0, backward=backward):
            assert abs((1 - busy / makespan) - (stages - 1) / (micro + stages - 1)) < 1e-12  # (S-1)/(M+S-1)
    assert forward_only(3) == [a for a in one_f_one_b(stages - 1, stages, 3) if a.phase is Phase.FORWARD]


def test_simulate_reports_a_deadlock() -> None:
    backwards_first = [list(reversed(one_f_one_b(0, 2, 2))), one_f_one_b(1, 2, 2)]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(backwards_first)


def test_activation_header_round_trip() -> None:
    value = (torch.ones(2, 3, requires_grad=True) * 2, torch.arange(4), torch.zeros((), dtype=torch.bfloat16))
    packed, metas = _decode(_encode(True, list(value)))
    assert packed and metas == [(torch.float32, True, (2, 3)), (torch.int64, False, (4,)), (torch.bfloat16, False, ())]
    with pytest.raises(ValueError, match="does not fit"):
        _encode(False, [torch.zeros([1] * 8)] * 4)
