"""PyTorch Lightning on a shardwise engine: ``Trainer(strategy=ShardwiseStrategy(stage=3))``.

An optional extra (``pip install 'shardwise[lightning]'``; ``import shardwise`` never imports Lightning) for
``lightning.pytorch`` and ``pytorch_lightning``: importing it registers ``"shardwise"``, ``"shardwise_stage_0"``
... ``"shardwise_stage_3_offload"`` in each one already imported.  See docs/lightning.md.
"""

from __future__ import annotations

from . import flavour as _flavour
from .consolidation import convert_zero_checkpoint_to_fp32_state_dict
from .precision import ShardwisePrecision
from .strategy import ShardwiseStrategy, strategy_class

__all__ = ["ShardwisePrecision", "ShardwiseStrategy", "convert_zero_checkpoint_to_fp32_state_dict", "register"]


def register() -> None:
    """Put the strategy's names in the registry of every Lightning package imported so far (done at import;
    call it again after importing a Lightning package later)."""
    for name in _flavour.loaded():
        strategy_class(_flavour.load(name))


register()
