"""ShardwiseStrategy under Lightning's own Trainer, on 2 gloo ranks: against Lightning's DDPStrategy, one
process, and itself across a checkpoint.

All parts run in one launch (tests/_lightning_parts.py, imported only there): importing Lightning costs
each rank several seconds, more than the training itself. Each test reports one part.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shardwise.testing import run_distributed

#: torchrun sets it; Lightning then detects a torchelastic launch and uses the ranks it finds
ENV = {"TORCHELASTIC_RUN_ID": "shardwise-lightning-tests"}
PARTS = ["parity", "resume", "finetuning", "pytorch_lightning"]


def _rank(root: str) -> dict[str, dict[str, Any]]:
    import _lightning_parts  # here: Lightning is imported in the ranks only

    return _lightning_parts.run_parts(root, PARTS)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    root: Path = tmp_path_factory.mktemp("lightning")
    return run_distributed(_rank, 2, args=(str(root),), timeout=600, env=ENV)


def _part(ranks: list[dict[str, dict[str, Any]]], name: str) -> Any:
    failures = [f"rank {rank}:\n{outcome[name]['error']}" for rank, outcome in enumerate(ranks)
                if outcome[name]["error"]]
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)
    return ranks[0][name]["value"]


def test_trains_as_ddp_strategy_at_every_stage(ranks: Any) -> None:
    """Stages 0-3 in fp32 with accumulation, clipping and a step-interval schedule equal DDPStrategy within 1e-5
    (weights, sync_dist validation and test losses, predictions); manual optimization too; refusals at setup."""
    _part(ranks, "parity")


def test_save_and_resume_equals_a_straight_run(ranks: Any) -> None:
    """Resume from `trainer.save_checkpoint` equals a straight run (bit-exact at one stage, 1e-6 resharded from
    stage 1 to 3); a save on rank 0 alone errors naming rank 1; consolidation feeds `load_from_checkpoint`."""
    _part(ranks, "resume")


def test_base_finetuning_unfreezes_as_one_process(ranks: Any) -> None:
    """BaseFinetuning unfreezing a backbone at epoch 1 trains as one process over both ranks' batches at stages
    2 and 3 (1e-5). DDPStrategy's distance to it must be large, else the case could not tell a strategy that
    syncs the unfrozen backbone from one that does not."""
    distance = _part(ranks, "finetuning")
    print(f"DDPStrategy's largest distance to one process after unfreezing: {distance:.4f}")
    assert distance is not None and distance > 1e-3, distance


def test_pytorch_lightning_name(ranks: Any) -> None:
    """The strategy for `pytorch_lightning`'s Trainer, by name and built explicitly, equals its DDPStrategy."""
    _part(ranks, "pytorch_lightning")
