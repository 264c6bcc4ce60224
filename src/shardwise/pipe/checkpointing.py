"""Pipeline checkpoints through ``shardwise.checkpoint``'s public entry points.

The checkpoint layer reads an engine: its ``comm`` (who takes part), its
``strategy`` (which pieces of which parameters this rank holds) and its
``module`` (every state-dict name).  A pipeline engine hands it a
:class:`CheckpointView` instead of itself:

* ``comm`` is the whole world: every stage of every replica writes its pieces;
* ``strategy`` is the stage's :class:`~.strategy.PipelineStrategy`, whose
  parameter names are already global (a stage registers its layers under
  their global names), so the files are the same as a plain module's;
* ``module`` is a :class:`GlobalModule`: every name of the whole model, in
  the order ``to_sequential()`` has them, with this stage's live tensors and
  placeholders for the other stages' (``meta`` tensors, never read).  Buffers
  and frozen parameters, which the checkpoint layer writes from rank 0, are
  first collected there from their stages; on load, each rank reads them into
  a scratch tensor and keeps only its own.

So a pipeline checkpoint is a plain checkpoint: it loads into
``to_sequential()`` at any ZeRO stage and world size, and back.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch
from torch import nn

from .module import TIED_PREFIX

__all__ = ["CheckpointView", "GlobalModule", "global_order"]

#: one stage's entries as exchanged: (name, shape, dtype name, trainable)
Entry = tuple[str, list[int], str, bool]


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


class GlobalModule:
    """The whole pipeline's state-dict entries on one rank; see the module docstring."""

    def __init__(self, stage_module: nn.Module) -> None:
        self.stage_module = stage_module
        self.entries: dict[str, torch.Tensor] = {}

    def fill(self, tables: Sequence[Sequence[Entry]], tied_keys: Sequence[str], held: dict[str, torch.Tensor], loading: bool) -> None:
        """Name every entry of every stage: ``held`` (live or collected) where this rank has it,
        else a placeholder; on load, buffers and frozen parameters get a scratch tensor to be read into."""
        info = {name: (shape, dtype, trainable) for table in tables for name, shape, dtype, trainable in table}
        self.entries = {}
        for name in global_order([[e[0] for e in table] for table in tables], tied_keys):
            shape, dtype, trainable = info[name]
            if name in held:
                self.entries[name] = held[name]
            elif loading and not trainable:
                self.entries[name] = torch.zeros(shape, dtype=getattr(torch, dtype))
            else:
                self.entries[name] = torch.empty(shape, dtype=getattr(torch, dtype), device="meta")

    def state_dict(self, *args: Any, keep_vars: bool = False, **kwargs: Any) -> dict[str, torch.Tensor]:
        return {n: (t if keep_vars else t.detach()) for n, t in self.entries.items()}

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        return self.stage_module.named_parameters(*args, **kwargs)

    def parameters(self, *args: Any, **kwargs: Any) -> Iterator[nn.Parameter]:
        return self.stage_module.parameters(*args, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> Any:
        """Load the entries this stage holds (for a ``module_load_fn``)."""
        own = self.stage_module.state_dict()
        return self.stage_module.load_state_dict({k: v for k, v in state_dict.items() if k in own}, strict=strict)


class CheckpointView:
    """A pipeline engine as the checkpoint layer sees it: ``comm``, ``strategy`` and
    ``module`` replaced, everything else (config, optimizer, counters...) the engine's."""

    def __init__(self, engine: Any, comm: Any, strategy: Any, module: GlobalModule) -> None:
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "comm", comm)
        object.__setattr__(self, "strategy", strategy)
        object.__setattr__(self, "module", module)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_engine"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        # the load restores counters (global_steps...) on the engine itself
        setattr(object.__getattribute__(self, "_engine"), name, value)
