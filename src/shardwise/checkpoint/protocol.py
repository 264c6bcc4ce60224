"""What the checkpoint layer needs from an engine: one typed protocol.

``save_checkpoint`` and ``load_checkpoint`` see an engine only through :class:`Checkpointable`
(``Engine.checkpointable()``; a pipeline engine provides its own): its process group and settings, this
rank's ``ParamShard``s (fp32 masters and optimizer state, wherever the stage keeps them), the module's other
entries (read and written collectively where partitioned), and ``Stateful`` extras.  The layer never imports
the ZeRO stages and never sets an attribute on the engine.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Protocol

import torch
from torch import nn

from ..comm.distributed import Comm
from ..optim.param_state import ParamShard

__all__ = ["Apply", "Checkpointable", "OptimizerInfo", "Stateful"]

#: what a load applies once every rank has read its part (collective where the stage needs it)
Apply = Callable[[], None]


class Stateful(Protocol):
    """An object restored as a whole (torch's ``Stateful`` contract)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class OptimizerInfo(Protocol):
    """The inner optimizer as a checkpoint sees it: its class and its hyperparameters."""

    @property
    def class_name(self) -> str: ...

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The live param groups (a load updates their hyperparameters, never ``params``)."""


class Checkpointable(Protocol):
    """An engine, as :func:`~shardwise.checkpoint.save_checkpoint` and ``load_checkpoint`` use it."""

    @property
    def comm(self) -> Comm:
        """The engine's process group: every rank of it takes part in a save or load."""

    @property
    def name(self) -> Optional[str]:
        """The engine's name: a named engine's files live in ``TAG/<name>/`` (see ``group.py``)."""

    @property
    def settings(self) -> Any:
        """The config's ``checkpoint`` section (timeout, allow_pickle, save_rng_state, async_save)."""

    @property
    def stage(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype."""

    @property
    def module(self) -> nn.Module:
        """The wrapped model: its ``state_dict`` keys name the checkpoint's entries."""

    @property
    def global_steps(self) -> int:
        """For the default tag ``global_step{N}``."""

    @property
    def optimizer(self) -> Optional[OptimizerInfo]:
        """None for an inference-only engine."""

    def shards(self, loading: bool, wanted: frozenset[str] = frozenset()) -> contextlib.AbstractContextManager[list[ParamShard]]:
        """This rank's parameter pieces (see ``Strategy.checkpoint_shards``); collective on exit."""

    def group_names(self) -> list[list[str]]:
        """Each param group's parameters by name, in the order the user's optimizer listed them."""

    def save_entries(self, live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full values of the module entries ``live`` that this rank writes (collective)."""

    def load_entries(self, live: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Apply]:
        """Fresh tensors to read the module entries into, and the (collective) step that applies them."""

    def writable_full_params(self) -> contextlib.AbstractContextManager[None]:
        """Inside, parameters hold full values and rank 0's writes are kept (collective)."""

    def extras(self) -> dict[str, Stateful]:
        """Restored whole: ``precision`` and ``counters`` always, ``scheduler`` when there is one."""

    def weights_16bit(self) -> Optional[dict[str, torch.Tensor]]:
        """A compute-dtype ``state_dict`` to write next to the shards (rank 0; None: none asked for); collective:
        DeepSpeed's ``stage3_gather_16bit_weights_on_model_save``."""

    def after_load(self) -> None:
        """Make the model's parameters equal to the loaded masters (collective)."""
