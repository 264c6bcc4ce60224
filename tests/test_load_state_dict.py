"""`shardwise.zero.load_state_dict`: full weights into a partitioned model, one unit at a time."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _checkpoint_common import TiedNet, tied_model
from torch import nn

import shardwise
from shardwise.model_io.export import save_state_dict
from shardwise.testing import distributed_test, run_subtests
from shardwise.zero import GatheredParameters

_STAGE3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _reference(tmp: Path) -> dict[str, torch.Tensor]:
    """Weights of another TiedNet (seed 5), written by rank 0 as .safetensors and .pt."""
    state = tied_model(seed=5).state_dict()
    if dist.get_rank() == 0:
        save_state_dict(state, tmp / "model.safetensors")
        save_state_dict(state, tmp / "model.pt")
    dist.barrier()
    return state


def _full(module: nn.Module) -> dict[str, torch.Tensor]:
    params = list(module.parameters())
    with GatheredParameters(params):
        return {n: t.detach().clone().float() for n, t in module.state_dict().items()}


@distributed_test(world_size=2, timeout=180)
def test_loads_into_zero_init_model_and_engines(tmp_path: Path) -> None:
    want = _reference(tmp_path)

    def case(source: str, when: str) -> None:
        path: Any = want if source == "dict" else tmp_path / f"model.{source}"
        if when == "before initialize":  # a teacher built partitioned, loaded, then wrapped
            with shardwise.zero.Init(config=_STAGE3):
                model = TiedNet()
            result = shardwise.zero.load_state_dict(model, path)
            assert result == ([], []), result
            engine = shardwise.initialize(model, None, {**_STAGE3, "bf16": {"enabled": True}})
            torch.testing.assert_close(_full(model), {k: v.to(torch.bfloat16).float() for k, v in want.items()},
                                       rtol=0, atol=0)
        else:  # into a training bf16 engine: the fp32 masters take the exact values
            model = tied_model(seed=1)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            engine = shardwise.initialize(model, optimizer, {**_STAGE3, "bf16": {"enabled": True}})
            shardwise.zero.load_state_dict(model, path)
            masters = engine.full_state_dict()
            if dist.get_rank() == 0:
                torch.testing.assert_close(masters, {k: v.float() for k, v in want.items()}, rtol=0, atol=0)
        engine.destroy()

    cases = [{"source": s, "when": w} for s in ("safetensors", "pt", "dict")
             for w in ("before initialize", "after initialize")]
    run_subtests(case, cases)


@distributed_test(world_size=2, timeout=180)
def test_mismatches_are_errors_on_every_rank(tmp_path: Path) -> None:
    want = _reference(tmp_path)
    with shardwise.zero.Init(config=_STAGE3):
        model = TiedNet()
    before = _full(model)
    partial = {k: v for k, v in want.items() if not k.startswith("mid.")}
    with pytest.raises(ValueError, match=r"missing keys .*'mid.bias', 'mid.weight'"):
        shardwise.zero.load_state_dict(model, partial)
    with pytest.raises(ValueError, match=r"unexpected keys .*'extra'"):
        shardwise.zero.load_state_dict(model, {**want, "extra": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"shapes differ .*`proj.weight`"):
        shardwise.zero.load_state_dict(model, {**want, "proj.weight": torch.zeros(3, 3)})
    torch.testing.assert_close(_full(model), before, rtol=0, atol=0)  # refused: nothing changed
    result = shardwise.zero.load_state_dict(model, partial, strict=False)
    assert result.missing_keys == ["mid.bias", "mid.weight"], result
    got = _full(model)
    torch.testing.assert_close(got["mid.weight"], before["mid.weight"], rtol=0, atol=0)  # kept
    torch.testing.assert_close(got["proj.weight"], want["proj.weight"], rtol=0, atol=0)  # loaded


class _Wide(nn.Module):
    def __init__(self, layers: int = 32, width: int = 512) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))


def _rss_anon_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def _peak_anon_growth_mib(fn: Any) -> float:
    """Peak anonymous resident memory gained while ``fn`` ran, sampled every millisecond.

    Anonymous memory is what loading allocates; pages of a memory-mapped file
    are the page cache's, not the process's, and the OS drops them as needed.
    """
    start, peak, done = _rss_anon_mib(), [0.0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_anon_mib())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], _rss_anon_mib()) - start


@distributed_test(world_size=2, timeout=180)
def test_peak_memory_is_about_one_unit(tmp_path: Path) -> None:
    torch.manual_seed(0)
    if dist.get_rank() == 0:
        save_state_dict(_Wide().state_dict(), tmp_path / "wide.safetensors")
    dist.barrier()
    with shardwise.zero.Init(config=_STAGE3):
        model = _Wide()
    full_mib = sum(p.numel() for p in model.parameters()) * 4 / 2**20  # 32.1 MiB in fp32
    shardwise.zero.load_state_dict(model, tmp_path / "wide.safetensors")  # first: one-time costs (arenas, gloo)
    # The lower of two loads: on a loaded machine one load's peak can catch transient buffers (up to
    # ~10 MiB on rank 0 seen while another launch ran); a load that materialised the model would
    # show its 32 MiB in both.
    growth = min(_peak_anon_growth_mib(lambda: shardwise.zero.load_state_dict(model, tmp_path / "wide.safetensors"))
                 for _ in range(2))
    unit_mib = full_mib / 32
    print(f"rank {dist.get_rank()}: peak anonymous memory growth {growth:.1f} MiB while loading a {full_mib:.1f} MiB model "
          f"(one unit {unit_mib:.1f} MiB)")
    assert growth < full_mib / 4, f"peak growth {growth:.1f} MiB is not far below the model's {full_mib:.1f} MiB"
