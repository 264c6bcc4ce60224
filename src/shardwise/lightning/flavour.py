"""Which Lightning package a strategy is built for: ``lightning.pytorch`` or ``pytorch_lightning``.

Each Trainer accepts only strategies built on its own package's ``Strategy``, so the strategy class is built once
per package from one source (:mod:`.strategy`), and :func:`chosen` picks the package a plain
``ShardwiseStrategy(...)`` is for.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

__all__ = ["PACKAGES", "Flavour", "chosen", "load", "loaded"]

#: the import names Lightning ships under, preferred first when neither is imported yet
PACKAGES = ("lightning.pytorch", "pytorch_lightning")


@dataclass(frozen=True, eq=False)
class Flavour:
    """The pieces of one Lightning package the strategy uses (one per package: :func:`load` keeps it)."""

    name: str
    package: ModuleType
    DDPStrategy: type
    Precision: type
    LightningModule: type
    LRSchedulerConfig: Any
    StrategyRegistry: Any
    TrainerFn: Any
    init_optimizers: Any
    is_overridden: Any


@functools.cache
def load(name: str) -> Flavour:
    """Import the package ``name`` (one of :data:`PACKAGES`) and gather its pieces."""
    if name not in PACKAGES:
        raise ValueError(f"Lightning package `{name}` is not one of {list(PACKAGES)}")
    try:
        package = importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(f"shardwise.lightning needs `{name}`: pip install 'shardwise[lightning]' ({exc})") from exc
    part = functools.partial(_part, name)
    return Flavour(
        name=name,
        package=package,
        DDPStrategy=part("strategies").DDPStrategy,
        Precision=part("plugins.precision").Precision,
        LightningModule=package.LightningModule,
        LRSchedulerConfig=part("utilities.types").LRSchedulerConfig,
        StrategyRegistry=part("strategies").StrategyRegistry,
        TrainerFn=part("trainer.states").TrainerFn,
        init_optimizers=part("core.optimizer")._init_optimizers_and_lr_schedulers,
        is_overridden=part("utilities.model_helpers").is_overridden,
    )


def _part(name: str, module: str) -> ModuleType:
    return importlib.import_module(f"{name}.{module}")


def loaded() -> list[str]:
    """The Lightning packages this process has imported."""
    return [name for name in PACKAGES if name in sys.modules]


def chosen() -> str:
    """The package a plain ``ShardwiseStrategy(...)`` is built for: the one imported; with none imported,
    the first installed; with both imported, an error (the Trainer it is for cannot be told)."""
    names = loaded()
    if len(names) == 1:
        return names[0]
    if len(names) > 1:
        raise RuntimeError(
            "both `lightning` and `pytorch_lightning` are imported, so `ShardwiseStrategy(...)` cannot tell which "
            "package's Trainer it is for; pass the strategy by name, which the Trainer looks up in its own package "
            "(`Trainer(strategy=\"shardwise_stage_3\")`, after `import shardwise.lightning`), or build it for one "
            "package: `ShardwiseStrategy.built_for(\"pytorch_lightning\")(stage=3)`")
    for name in PACKAGES:
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            return name
    raise ImportError("shardwise.lightning needs Lightning: pip install 'shardwise[lightning]'")
