"""Reading and writing partitioned parameters outside a forward, and external parameters."""

from __future__ import annotations

from types import TracebackType
from typing import Any, Iterable, Optional, Union

import torch
from torch import nn

from ...faults.announce import Announcer, register
from .hooks import EXTERNAL_ATTR
from .params import Unit, gather_units, unit_of

__all__ = ["GatheredParameters", "register_external_parameter"]


class GatheredParameters:
    """Inside the block, the given partitioned parameters hold their full values (collective).

    Every rank must enter it with the same parameters in the same order.
    Without ``modifier_rank`` the block is read-only: writes are discarded
    when it exits.  With ``modifier_rank=r``, what rank ``r`` wrote is
    broadcast on exit and re-partitioned on every rank (and, when a stage 3
    engine owns the parameters, copied into its fp32 master weights).
    Parameters that are not partitioned (another stage, a plain module) are
    left alone, so the same code runs at every stage::

        with shardwise.zero.GatheredParameters(model.head.weight, modifier_rank=0):
            if dist.get_rank() == 0:
                model.head.weight[:10].zero_()

    ``fwd_module`` is accepted for DeepSpeed compatibility and ignored.  Collective, so it announces itself first
    (:mod:`shardwise.faults.announce`): a rank entering it alone raises, with the others, before anything is gathered.
    """

    def __init__(
        self,
        params: Union[torch.Tensor, Iterable[torch.Tensor], None],
        modifier_rank: Optional[int] = None,
        fwd_module: Optional[nn.Module] = None,
        enabled: bool = True,
    ) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = list(params) if params is not None and enabled else []
        self.modifier_rank = modifier_rank
        self._scope: Any = None
        self.units: list[Unit] = []
        for param in self.params:
            if not isinstance(param, torch.Tensor):
                raise TypeError(
                    f"GatheredParameters got a `{type(param).__name__}`; pass a parameter or a list of "
                    "parameters, e.g. `GatheredParameters(module.parameters())`"
                )
            unit = unit_of(param)
            if unit is not None and unit not in self.units:
                self.units.append(unit)
        if modifier_rank is not None and self.units:
            world = self.units[0].comm.world_size
            if not 0 <= modifier_rank < world:
                raise ValueError(
                    f"modifier_rank={modifier_rank} is not a rank of the parameters' process group "
                    f"(size {world}); pass a rank in [0, {world}) or None for read-only access"
                )

    def __enter__(self) -> "GatheredParameters":
        if self.units:
            self._scope = _announcer_of(self.units[0]).scope("GatheredParameters").open()
        try:
            for unit in self.units:
                unit.acquire()
            gather_units(self.units)
        except BaseException:
            self._close()
            raise
        return self

    def _close(self) -> None:
        scope, self._scope = self._scope, None
        if scope is not None:
            scope.close()

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        try:
            if self.modifier_rank is not None and exc_type is None:
                for unit in self.units:
                    unit.scatter_from_full(src=self.modifier_rank)
                    unit.owner.on_params_modified(unit)
            elif self.modifier_rank is None:
                # Read-only: undo local writes so the full values keep matching the shards.
                for unit in self.units:
                    if unit.holders > 1 or unit.persistent:
                        unit.refresh()
        finally:
            try:
                for unit in self.units:
                    unit.owner.release(unit)
            finally:
                self._close()


def _announcer_of(unit: Unit) -> Announcer:
    """Who announces for ``unit``: the engine that owns it, or (a model under ``zero.Init`` not yet wrapped) a
    bare announcer on the unit's group."""
    announcer = getattr(unit.owner, "announcer", None)
    if isinstance(announcer, Announcer):
        return announcer
    return Announcer(unit.comm, "a model partitioned by `zero.Init`", engine=False)


register("GatheredParameters.__enter__", "GatheredParameters")


def register_external_parameter(module: nn.Module, parameter: torch.Tensor) -> None:
    """Gather ``parameter`` whenever ``module`` runs, like its own parameters.

    A parameter read inside a module's forward that belongs to another module (``F.linear(x, self.child.weight)`` on a
    child the forward never calls) is gathered automatically at stage 3; registering it only lets the gather happen up
    front, with prefetching, instead of at the first read.  Works before or after ``shardwise.initialize``; a no-op for
    parameters that are not partitioned.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"register_external_parameter: `module` must be a torch.nn.Module, got `{type(module).__name__}`"
        )
    if not isinstance(parameter, torch.Tensor):
        raise TypeError(
            f"register_external_parameter: `parameter` must be a tensor (an nn.Parameter), got "
            f"`{type(parameter).__name__}`"
        )
    registered = module.__dict__.setdefault(EXTERNAL_ATTR, [])
    if not any(p is parameter for p in registered):
        registered.append(parameter)

