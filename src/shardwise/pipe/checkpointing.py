"""A pipeline engine behind the checkpoint protocol (``shardwise.checkpoint.protocol.Checkpointable``).

:class:`PipelineState` is a plain engine's state with the whole world as ``comm``, a :class:`GlobalModule` (every name
of the whole model in ``to_sequential()``'s order, ``meta`` placeholders for other stages'), and a tied weight written
once, by its first stage (ZeRO-1 cuts its pieces at other offsets on other stages, and overlapping pieces of one tensor
are not a valid DCP checkpoint). So a pipeline checkpoint loads into ``to_sequential()`` at any ZeRO stage and world
size, and back into a pipeline of any replica count or partition (docs/pipeline.md).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch
from torch import nn

from ..comm.distributed import Comm
from ..engine.state import EngineState
from ..optim.param_state import ParamShard
from .module import TIED_PREFIX, PipelineModule
from .ties import TiedWeights
from .topology import PipeGroups

if TYPE_CHECKING:
    from ..checkpoint.protocol import Apply
    from ..engine.engine import Engine

__all__ = ["GlobalModule", "PipelineState", "global_order"]

#: one stage's entries as exchanged: (name, shape, dtype name)
Entry = tuple[str, list[int], str]


def global_order(per_stage: Sequence[Sequence[str]], tied_keys: Sequence[str]) -> list[str]:
    """All stages' names in ``to_sequential()``'s order: tied modules by key, then layers by index."""
    position = {key: i for i, key in enumerate(tied_keys)}
    seen: set[str] = set()
    tied: list[tuple[int, int, str]] = []
    layers: list[str] = []
    for names in per_stage:
        for at, name in enumerate(names):
            if name in seen:
                continue
            seen.add(name)
            if name.startswith(TIED_PREFIX):
                tied.append((position[name[len(TIED_PREFIX) :].split(".", 1)[0]], at, name))
            else:
                layers.append(name)
    return [name for *_, name in sorted(tied)] + layers


class GlobalModule(nn.Module):
    """The whole pipeline's state-dict entries on one rank. Not a real module: it only answers ``state_dict``;
    ``named_parameters`` and ``load_state_dict`` (for a ``module_load_fn``) reach this stage's module."""

    stage_module: nn.Module

    def __init__(self, stage_module: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "stage_module", stage_module)  # not a child: its names stay unprefixed
        self.entries: dict[str, torch.Tensor] = {}
        #: the first stage holding each name (it writes the name's module entry)
        self.first_stage: dict[str, int] = {}

    def fill(self, tables: Sequence[Sequence[Entry]], tied_keys: Sequence[str]) -> None:
        """Every stage's names (``tables[s]``, from :meth:`describe`), live where this stage holds them."""
        local = self.stage_module.state_dict(keep_vars=True)
        info: dict[str, Entry] = {}
        self.first_stage = {}
        for stage, table in enumerate(tables):
            for entry in table:
                info.setdefault(entry[0], entry)
                self.first_stage.setdefault(entry[0], stage)
        self.entries = {
            name: local[name] if name in local else torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
            for name, shape, dtype in (info[n] for n in global_order([[e[0] for e in t] for t in tables], tied_keys))}

    def describe(self) -> list[Entry]:
        """This stage's entries, to exchange with the other stages."""
        return [(n, list(t.shape), str(t.dtype).replace("torch.", "")) for n, t in self.stage_module.state_dict().items()]

    def state_dict(self, *args: Any, keep_vars: bool = False, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return {n: (t if keep_vars else t.detach()) for n, t in self.entries.items()}

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        return self.stage_module.named_parameters(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load the entries this stage holds."""
        own = self.stage_module.state_dict()
        return self.stage_module.load_state_dict({k: v for k, v in state_dict.items() if k in own}, strict, assign)


class PipelineState(EngineState):
    """A pipeline engine behind the checkpoint protocol (see the module docstring): ``engine`` is
    this rank's, over its stage ``module``; ``groups`` and ``ties`` are the pipeline's."""

    def __init__(self, engine: "Engine", module: PipelineModule, groups: PipeGroups, ties: TiedWeights) -> None:
        super().__init__(engine)
        self._stage, self._groups, self._ties = module, groups, ties
        self._global = GlobalModule(module)

    @property
    def comm(self) -> Comm:
        return self._groups.world

    @property
    def module(self) -> nn.Module:
        return self._global

    @contextlib.contextmanager
    def shards(self, loading: bool, wanted: frozenset[str] = frozenset()) -> Iterator[list[ParamShard]]:
        # Every rank has joined the save or load: the stages share their names (collective).
        tables = self._groups.pipe.all_gather_object(self._global.describe())
        self._global.fill(tables, self._stage.tied_keys)
        copies = self._ties.written_elsewhere()
        with self._strategy.checkpoint_shards(loading, wanted) as shards:
            yield shards if loading else [s for s in shards if s.name not in copies]

    def _held_here(self, live: dict[str, torch.Tensor], writing: bool) -> dict[str, torch.Tensor]:
        stage, local = self._stage.stage_id, self._stage.state_dict(keep_vars=True)
        return {n: local[n] for n in live if n in local and (not writing or self._global.first_stage[n] == stage)}

    def save_entries(self, live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # The stage's strategy picks its first replica to write them.
        return self._strategy.save_entries(self._held_here(live, writing=True))

    def load_entries(self, live: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], "Apply"]:
        return self._strategy.load_entries(self._held_here(live, writing=False))
