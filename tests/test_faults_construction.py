"""Ranks that build different engines are stopped at `initialize`, on every rank, naming the difference.

Each case below trained silently wrong before the construction agreement compared
fingerprints (the ranks compared only parameter counts and total sizes): the
modules registered in another order (a model built by iterating a `set`), a
parameter transposed, another dtype, another lr (passed optimizer or config
section), another `gradient_clipping`, and a two-stage pipeline whose stages got
different configs.  Each must end in `CollectiveMismatchError` on every rank, naming
the first differing parameter (or key) with its value on each rank, within the
agreement's `checkpoint.timeout`.  Keys that may differ per rank (`seed`,
`wall_clock_breakdown`, the timeouts) still train as torch DDP does (1e-5).

All cases run in one two-rank launch (``run_subtests``); each rank returns how
every case ended and the test checks them here.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from _faults_common import COMMS_TIMEOUT, fault_config, record_row, train_step
from _parity import adamw, assert_close_params, ddp_reference, make_model, params_of
from _pipe_models import micro_batches, pipeline, tied_layers
from torch import nn

import shardwise
from shardwise.comm.fingerprint import client_fingerprint, config_fingerprint, module_fingerprint
from shardwise.testing import run_distributed, run_subtests

#: the DDP-parity tolerance of the legitimate case (fp32; a plain DDP run reaches ~1e-7)
ATOL = 1e-5
STAGES = (0, 1, 2, 3)


class Ordered(nn.Module):
    """Two layers registered in the order given: `fc1` (8 -> 16) and `fc2` (16 -> 8), the same names and total
    size on every rank, as a model built by iterating a `set` of layer names would be."""

    def __init__(self, order: tuple[str, ...], fc2_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        layers = {"fc1": lambda: nn.Linear(8, 16), "fc2": lambda: nn.Linear(16, 8, dtype=fc2_dtype)}
        for name in order:
            setattr(self, name, layers[name]())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)).to(self.fc2.weight.dtype)).float()


class Stored(nn.Module):
    """One weight `w` of 128 elements, stored 16x8 or 8x16 (the same name and size)."""

    def __init__(self, transposed: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 16) if transposed else torch.randn(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w.t() if self.w.shape[0] == 8 else self.w
        return x @ w


def _mine(values: tuple[Any, Any]) -> Any:
    """Rank 0 gets the first value, rank 1 the second."""
    return values[dist.get_rank()]


def _build(case: str, stage: int) -> Any:
    """Build the engine of ``case``: rank 1 differs from rank 0 in one thing."""
    torch.manual_seed(0)
    config = fault_config(stage)
    if case == "order":
        model: nn.Module = Ordered(_mine((("fc1", "fc2"), ("fc2", "fc1"))))
    elif case == "shape":
        model = Stored(_mine((False, True)))
    elif case == "dtype":
        model = Ordered(("fc1", "fc2"), _mine((torch.float32, torch.float64)))
    else:
        model = Ordered(("fc1", "fc2"))
    if case == "config lr":
        config["optimizer"] = {"type": "AdamW", "params": {"lr": _mine((1e-2, 2e-2))}}
        return shardwise.initialize(model, config=config)
    if case == "clipping":
        config["gradient_clipping"] = _mine((1.0, 0.5))
    lr = _mine((1e-2, 2e-2)) if case == "client lr" else 1e-2
    return shardwise.initialize(model, adamw(model.parameters(), lr=lr), config)


def _build_pipeline(case: str, stage: int) -> Any:
    config = {**fault_config(stage), "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "gradient_clipping": _mine((1.0, 0.5)),
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine = shardwise.initialize(pipeline(tied_layers(), num_stages=2), config=config)
    engine.train_batch(micro_batches(0, 2))
    return engine


def _ended(build: Callable[[str, int], Any], case: str, stage: int, results: list[dict[str, Any]]) -> None:
    start = time.monotonic()
    error: Optional[BaseException] = None
    try:
        build(case, stage)
    except Exception as exc:  # noqa: BLE001 - reported, the test decides
        error = exc
    results.append({"case": case, "stage": stage, "seconds": time.monotonic() - start,
                    "error": None if error is None else type(error).__name__, "message": str(error or "")})


def _per_rank_keys_case(stage: int) -> None:
    """Keys a rank may set on its own still build one engine, which trains as DDP does (at stage 3 with the
    config's optimizer over `model_parameters` given as a generator, which must reach the optimizer whole)."""
    own = {"seed": _mine((1, 2)), "wall_clock_breakdown": _mine((False, True)),
           "comms": {"timeout": _mine((COMMS_TIMEOUT, 2 * COMMS_TIMEOUT))},
           "checkpoint": {"timeout": _mine((COMMS_TIMEOUT, 2 * COMMS_TIMEOUT))}}
    model = make_model(0)
    if stage == 3:
        own["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}
        engine = shardwise.initialize(model, config=fault_config(stage, **own),
                                      model_parameters=(p for p in model.parameters()))
    else:
        engine = shardwise.initialize(model, adamw(model.parameters()), fault_config(stage, **own))
    for step in range(2):
        train_step(engine, step)
    if stage == 3:
        with shardwise.zero.GatheredParameters(list(engine.module.parameters())):
            got = params_of(engine.module)
    else:
        got = params_of(engine.module)
    assert_close_params(got, ddp_reference(2, adamw), atol=ATOL)


def _all_cases() -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    cases: list[dict[str, Any]] = [
        {"build": _build, "case": case, "stage": stage, "results": results}
        for case in ("order", "shape") for stage in STAGES
    ]
    cases += [{"build": _build, "case": case, "stage": 2, "results": results}
              for case in ("dtype", "client lr", "config lr", "clipping")]
    cases.append({"build": _build_pipeline, "case": "pipeline clipping", "stage": 1, "results": results})
    run_subtests(_ended, cases)
    run_subtests(_per_rank_keys_case, [{"stage": stage} for stage in (0, 3)])
    return results


#: per case: the texts every rank's message must hold (the difference, with each rank's value)
EXPECTED = {
    "order": ["parameter #0: rank 0: `fc1.weight` (16, 8) float32; rank 1: `fc2.weight` (8, 16) float32",
              "the same entries, in a different order"],
    "shape": ["parameter #0: rank 0: `w` (16, 8) float32; rank 1: `w` (8, 16) float32"],
    "dtype": ["parameter #2: rank 0: `fc2.weight` (8, 16) float32; rank 1: `fc2.weight` (8, 16) float64"],
    "client lr": ["`optimizer.param_groups[0].lr`: rank 0: 0.01; rank 1: 0.02"],
    "config lr": ["`optimizer.params.lr`: rank 0: 0.01; rank 1: 0.02"],
    "clipping": ["`gradient_clipping`: rank 0: 1; rank 1: 0.5"],
    "pipeline clipping": ["pipeline engine (2 stages)", "`gradient_clipping`: rank 0: 1; rank 1: 0.5"],
}

ROWS = {
    "order": ("modules registered in another order on rank 1 (`fc2` before `fc1`: a model built by iterating a "
              "`set`; same names, same total size)",
              "every rank raises `CollectiveMismatchError` at `initialize`, naming the first differing parameter "
              "with its name and shape on each rank"),
    "shape": ("a parameter stored transposed on rank 1 (`w` 8x16 against 16x8: same name, same size)",
              "every rank raises `CollectiveMismatchError` at `initialize`, naming `w` with its shape on each rank"),
    "dtype": ("a parameter of another dtype on rank 1 (`fc2` in float64)",
              "every rank raises `CollectiveMismatchError` at `initialize`, naming `fc2.weight` with its dtype on "
              "each rank"),
    "client lr": ("another `lr` in the optimizer passed to `initialize` on rank 1",
                  "every rank raises `CollectiveMismatchError` at `initialize`, naming "
                  "`optimizer.param_groups[0].lr` with its value on each rank"),
    "config lr": ("another `optimizer.params.lr` in the config on rank 1",
                  "every rank raises `CollectiveMismatchError` at `initialize`, naming the key with its value on "
                  "each rank"),
    "clipping": ("another `gradient_clipping` on rank 1",
                 "every rank raises `CollectiveMismatchError` at `initialize`, naming the key with its value on "
                 "each rank"),
    "pipeline clipping": ("the stages of a two-stage pipeline get different configs (`gradient_clipping`)",
                          "every rank raises `CollectiveMismatchError` at `initialize`, naming the key with its "
                          "value on each rank"),
}


def test_ranks_that_build_different_engines_are_stopped_at_initialize() -> None:
    per_rank = run_distributed(_all_cases, 2, timeout=240)
    for index, case in enumerate(per_rank[0]):
        ends = [results[index] for results in per_rank]
        for rank, end in enumerate(ends):
            assert end["case"] == case["case"] and end["stage"] == case["stage"], (case, end)
            assert end["error"] == "CollectiveMismatchError", f"rank {rank}, {case['case']} at stage {case['stage']}: {end}"
            assert end["message"].startswith(f"rank {rank}: the ranks built different engines"), end["message"]
            for text in EXPECTED[case["case"]]:
                assert text in end["message"], f"{text!r} not in {end['message']!r}"
            assert end["seconds"] < COMMS_TIMEOUT, end
        fault, result = ROWS[case["case"]]
        record_row("disagree", fault, str(case["stage"]), result, max(end["seconds"] for end in ends))


# ------------------------------------------------------------ the fingerprints, one process
def _config_digest(**settings: Any) -> str:
    return config_fingerprint(shardwise.Config.load(settings)).digest


def test_config_fingerprint_skips_only_the_per_rank_keys() -> None:
    base = _config_digest()
    assert _config_digest(seed=3, wall_clock_breakdown=True, dist_timeout=60.0, comms={"timeout": 9.0},
                          checkpoint={"timeout": 9.0}) == base
    for settings in ({"steps_per_print": 5}, {"comms": {"debug": True}}, {"gradient_clipping": 1.0},
                     {"zero_optimization": {"reduce_bucket_size": 1000}}):
        assert _config_digest(**settings) != base, settings


def test_module_fingerprint_names_ties_and_frozen_parameters() -> None:
    model = Ordered(("fc1", "fc2"))
    model.fc1.bias.requires_grad_(False)
    model.head = nn.Linear(8, 16)
    model.head.weight = model.fc2.weight  # tied: one tensor under two names
    model.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
    entries = dict(module_fingerprint(model).entries)
    assert entries["parameter #1"] == "`fc1.bias` (16) float32 frozen"
    assert entries["parameter #4"] == "`head.weight` (8, 16) float32, the same tensor as `fc2.weight`"
    assert entries["buffer #0"] == "`steps` (3) int64"


def test_client_fingerprint_sees_hyperparameters_and_reads_no_iterator() -> None:
    model = Ordered(("fc1", "fc2"))
    groups = [{"params": iter(model.fc1.parameters()), "lr": 0.1}, {"params": list(model.fc2.parameters())}]
    entries = dict(client_fingerprint(model, None, None, groups).entries)
    assert "not read here" in entries["model_parameters[0].params"]
    assert next(groups[0]["params"]) is model.fc1.weight, "the iterator was consumed"
    assert entries["model_parameters[0].lr"] == "0.1"
    assert entries["model_parameters[1].params"] == "2 parameters: `fc2.weight`, `fc2.bias`"
    one = client_fingerprint(model, torch.optim.SGD(model.parameters(), lr=1), None, None).digest
    assert client_fingerprint(model, torch.optim.SGD(model.parameters(), lr=1.0), None, None).digest == one
    assert client_fingerprint(model, torch.optim.SGD(model.parameters(), lr=1, momentum=0.5), None, None).digest != one
