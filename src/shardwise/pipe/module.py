"""``PipelineModule``: one model definition, as a list of layers, cut into stages.

Names follow DeepSpeed's (``"3.weight"``, ``"tied_modules.embed.weight"``; callables have none), so a state dict reads
the same whichever way the model runs; a rank of a multi-stage pipeline registers only its stage's layers, under those
global names (docs/pipeline.md).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from ..comm.distributed import init_distributed
from .layers import (
    CheckpointFn,
    Layer,
    LayerSpec,
    PipelineSequential,
    TiedLayerSpec,
    build_on_meta,
    compute_loss,
    default_checkpoint,
    layer_name,
    run_layers,
)
from .partition import partition
from .topology import PipeTopology

__all__ = ["PipelineModule", "TIED_PREFIX"]

logger = logging.getLogger("shardwise")

#: where tied modules live in the state dict: ``tied_modules.<key>.<parameter>``
TIED_PREFIX = "tied_modules."

LayerEntry = Union[LayerSpec, nn.Module, Callable[[Any], Any]]


@dataclass(frozen=True)
class _Tie:
    """Where one tied key occurs, and what is kept equal across stages."""

    indices: tuple[int, ...]
    attrs: tuple[str, ...]


class PipelineModule(nn.Module):
    """A model given as a list of layers, trained pipelined or as a plain module.

    ``layers`` holds :class:`LayerSpec`, :class:`TiedLayerSpec`, ``nn.Module`` instances and any callable; each takes
    the previous one's output. ``num_stages`` cuts them by ``partition_method``; every argument in docs/pipeline.md.
    With more than one stage (and rank), construction needs the default process group (created from torchrun's
    environment if absent) and builds only this rank's stage; ``shardwise.initialize`` then returns a pipeline engine.
    """

    def __init__(
        self,
        layers: Sequence[LayerEntry],
        num_stages: Optional[int] = None,
        loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
        partition_method: Any = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Optional[CheckpointFn] = None,
        seed_layers: bool = False,
        base_seed: int = 1234,
    ) -> None:
        super().__init__()
        # First child, so `tied_modules.*` come first in the state dict (as in DeepSpeed).
        self.tied_modules = nn.ModuleDict()
        self._layers = _checked_layers(layers)
        self.loss_fn = loss_fn
        interval = self.activation_checkpoint_interval = activation_checkpoint_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise ValueError(f"activation_checkpoint_interval={interval!r}: expected an integer >= 0 (0 turns "
                             "checkpointing off, k recomputes every k layers in backward)")
        if activation_checkpoint_func is not None and not callable(activation_checkpoint_func):
            raise TypeError(
                f"activation_checkpoint_func must be callable `(function, *args) -> output`, got "
                f"{activation_checkpoint_func!r}")
        self.activation_checkpoint_func = activation_checkpoint_func or default_checkpoint
        self.seed_layers, self.base_seed = seed_layers, base_seed
        self._meta: dict[int, nn.Module] = {}
        self._ties = self._check_ties()
        self.num_stages, self.topology, self.stage_id = _placement(num_stages)
        names = [layer_name(layer) for layer in self._layers]
        self.parts = partition(names, self._weight, self.num_stages, partition_method)
        self._check_shared_instances()
        self._loose = self._untied_across_stages()
        self._meta.clear()  # only needed for planning
        self._steps: list[Layer] = self._build()

    # ------------------------------------------------------------ planning
    def _meta_of(self, index: int) -> nn.Module:
        spec = self._layers[index]
        assert isinstance(spec, LayerSpec)  # internal: only called for specs
        if index not in self._meta:
            self._meta[index] = build_on_meta(spec)
        return self._meta[index]

    def _weight(self, index: int) -> int:
        """Trainable parameters of layer ``index`` (what ``partition_method="parameters"`` balances)."""
        layer = self._layers[index]
        if isinstance(layer, LayerSpec):
            module = self._meta_of(index)
        elif isinstance(layer, nn.Module):
            module = layer
        else:
            return 0
        return sum(p.numel() for p in module.parameters() if p.requires_grad)

    def _check_ties(self) -> dict[str, _Tie]:
        """Every occurrence of a key builds the same class with the same tied shapes."""
        where: dict[str, list[tuple[int, TiedLayerSpec]]] = {}
        for index, layer in enumerate(self._layers):
            if isinstance(layer, TiedLayerSpec):
                where.setdefault(layer.key, []).append((index, layer))
        for key, found in where.items():
            expected = self._tied_shapes(*found[0])
            for other in found[1:]:
                _same_tie(key, found[0], other, expected, self._tied_shapes(*other))
        return {key: _Tie(tuple(i for i, _ in found), tuple(found[0][1].tied_weight_attr)) for key, found in where.items()}

    def _tied_shapes(self, index: int, spec: TiedLayerSpec) -> dict[str, tuple[int, ...]]:
        module = self._meta_of(index)
        shapes = {}
        for attr in spec.tied_weight_attr:
            try:
                shapes[attr] = tuple(module.get_parameter(attr).shape)
            except AttributeError:
                raise ValueError(
                    f"TiedLayerSpec `{spec.key}` (layer {index}): `{spec.name}` has no parameter `{attr}`; "
                    f"tied_weight_attr must name parameters of the module, e.g. one of "
                    f"{[n for n, _ in module.named_parameters()][:8]}") from None
        return shapes

    def _check_shared_instances(self) -> None:
        """One module object at two positions on different stages would silently become two copies."""
        stages: dict[int, set[int]] = {}
        for index, layer in enumerate(self._layers):
            if isinstance(layer, nn.Module):
                stages.setdefault(id(layer), set()).add(self.stage_of_layer(index))
        for index, layer in enumerate(self._layers):
            if isinstance(layer, nn.Module) and len(stages[id(layer)]) > 1:
                raise ValueError(
                    f"layer {index} (`{type(layer).__name__}`) is one module object used on stages "
                    f"{sorted(stages[id(layer)])}: each stage would train its own copy. Share it with "
                    f"`TiedLayerSpec(key, {type(layer).__name__}, ...)` instead")

    def _untied_across_stages(self) -> list[tuple[str, str]]:
        """``(key, parameter name)`` of the parameters of tied modules on several stages that are *not*
        kept equal: as in DeepSpeed they are allowed (a position table only the first stage uses), as
        long as only one stage trains them (checked at every ``train_batch``)."""
        loose = []
        for key, tie in self._ties.items():
            if len(self.stages_of_tie(key)) > 1:
                module = self._meta_of(tie.indices[0])
                loose += [(key, n) for n, _ in module.named_parameters() if n not in tie.attrs]
        return loose

    # ------------------------------------------------------------ building
    def _construct(self, index: int, spec: LayerSpec) -> nn.Module:
        if not self.seed_layers:
            return spec.build()
        # The user's random stream continues as if nothing was built.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.base_seed + index)
            return spec.build()

    def _build(self) -> list[Layer]:
        built: dict[str, nn.Module] = {}
        steps: list[Layer] = []
        for index in self.stage_layers():
            layer = self._layers[index]
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in built:
                    # Seeded by the key's first position in the model, so every stage builds it alike.
                    built[layer.key] = self._construct(self._ties[layer.key].indices[0], layer)
                module = built[layer.key]
                # partial binds this module now: no late-binding closure over the loop variable
                steps.append(module if layer.forward_fn is None else functools.partial(layer.forward_fn, module))
            elif isinstance(layer, (LayerSpec, nn.Module)):
                module = self._construct(index, layer) if isinstance(layer, LayerSpec) else layer
                self.add_module(str(index), module)
                steps.append(module)
            else:
                steps.append(layer)
        for key in self._ties:  # registration in the model's key order, whatever the stage
            if key in built:
                self.tied_modules[key] = built[key]
        return steps

    # ------------------------------------------------------------ queries
    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def stage_layers(self, stage: Optional[int] = None) -> range:
        """Indices of the layers stage ``stage`` (default: this rank's) runs."""
        stage = self.stage_id if stage is None else stage
        return range(self.parts[stage], self.parts[stage + 1])

    def stage_of_layer(self, index: int) -> int:
        return next(s for s in range(self.num_stages) if self.parts[s] <= index < self.parts[s + 1])

    @property
    def tied_keys(self) -> list[str]:
        """Every tied key of the model, in order of first occurrence."""
        return list(self._ties)

    def stages_of_tie(self, key: str) -> tuple[int, ...]:
        return tuple(sorted({self.stage_of_layer(i) for i in self._ties[key].indices}))

    def untied_parameters(self) -> list[tuple[str, str, Optional[nn.Parameter]]]:
        """``(key, name, parameter or None)`` for every parameter of a tied module spanning stages that
        is not in ``tied_weight_attr``, in the same order on every rank; the parameter is None on a
        stage that does not hold the key."""
        return [(key, name, self.tied_modules[key].get_parameter(name) if key in self.tied_modules else None)
                for key, name in self._loose]

    def tied_parameters(self) -> Iterator[tuple[str, tuple[int, ...], list[tuple[str, nn.Parameter]]]]:
        """For each key this stage shares with other stages: ``(key, its stages, [(name, parameter)])``
        of the parameters kept equal across them."""
        for key, tie in self._ties.items():
            stages = self.stages_of_tie(key)
            if len(stages) > 1 and key in self.tied_modules:
                module = self.tied_modules[key]
                params = [(f"{TIED_PREFIX}{key}.{attr}", module.get_parameter(attr)) for attr in tie.attrs]
                yield key, stages, params

    # ------------------------------------------------------------ running
    def forward(self, inputs: Any, labels: Any = None) -> Any:
        """Run this stage's layers on ``inputs``; with ``labels``, return ``loss_fn(outputs, labels)``."""
        outputs = run_layers(self._steps, inputs, self.activation_checkpoint_interval, self.activation_checkpoint_func)
        if labels is None:
            return outputs
        if not self.is_last_stage:
            raise RuntimeError(
                f"labels were passed to stage {self.stage_id} of {self.num_stages}: only the last stage computes "
                "the loss; train a multi-stage pipeline with `engine.train_batch(data_iter)`")
        return compute_loss(self.loss_fn, outputs, labels)

    def to_sequential(self) -> nn.Module:
        """A plain ``nn.Module`` running every layer in order, sharing this module's layers.

        Tied keys stay one module (one Parameter, whose gradient sums every use), ``forward_fn``s stay bound to it,
        callables are kept, and activation checkpointing runs at the same interval.  State-dict names are the same as
        this module's.  Needs no process group; only a module holding every layer (one stage) can be exported.
        """
        if self.num_stages > 1:
            raise RuntimeError(
                f"to_sequential() on stage {self.stage_id} of a {self.num_stages}-stage pipeline: this rank holds "
                f"only layers [{self.parts[self.stage_id]}, {self.parts[self.stage_id + 1]}) of {self.num_layers}. "
                "Build the model whole with `PipelineModule(layers, num_stages=1).to_sequential()`; a pipeline "
                "checkpoint loads into it by name")
        children = [(name, child) for name, child in self.named_children() if child is not self.loss_fn]
        return PipelineSequential(children, self._steps, self.loss_fn, self.activation_checkpoint_interval,
                                  self.activation_checkpoint_func)

    def extra_repr(self) -> str:
        return f"stage {self.stage_id} of {self.num_stages}, layers [{self.parts[self.stage_id]}, {self.parts[self.stage_id + 1]}) of {self.num_layers}"


def _checked_layers(layers: Sequence[LayerEntry]) -> list[LayerEntry]:
    if isinstance(layers, nn.Module) or not hasattr(layers, "__iter__"):
        raise TypeError(
            f"`layers` must be a list of LayerSpec / nn.Module / callables, got a `{type(layers).__name__}`; "
            "for an nn.Sequential pass `list(seq)`")
    checked = list(layers)
    for index, layer in enumerate(checked):
        if isinstance(layer, PipelineModule):
            raise TypeError(f"layer {index} is itself a PipelineModule; nest its layers instead (`[*a_layers, *b_layers]`)")
        if not (isinstance(layer, LayerSpec) or callable(layer)):
            raise TypeError(
                f"layer {index} is a `{type(layer).__name__}`, which is neither a LayerSpec, an nn.Module nor "
                "callable; every layer must map the previous output to the next")
    if not checked:
        raise ValueError("`layers` is empty; a PipelineModule needs at least one layer")
    return checked


def _same_tie(
    key: str,
    first: tuple[int, TiedLayerSpec],
    other: tuple[int, TiedLayerSpec],
    expected: dict[str, tuple[int, ...]],
    found: dict[str, tuple[int, ...]],
) -> None:
    (i, a), (j, b) = first, other
    if a.cls is not b.cls:
        raise ValueError(
            f"TiedLayerSpec key `{key}`: layer {i} builds `{a.name}` but layer {j} builds `{b.name}`; every "
            f"occurrence of a key shares one module, so they must build the same class (use another key for a "
            "different module)")
    if a.tied_weight_attr != b.tied_weight_attr:
        raise ValueError(
            f"TiedLayerSpec key `{key}`: layer {i} ties {a.tied_weight_attr} but layer {j} ties "
            f"{b.tied_weight_attr}; give every occurrence the same `tied_weight_attr`")
    if expected != found:
        raise ValueError(
            f"TiedLayerSpec key `{key}`: layer {i} builds tied weights of shapes {expected} but layer {j} of "
            f"{found}; every occurrence shares one module, so build them with the same arguments")


def _placement(num_stages: Optional[int]) -> tuple[int, Optional[PipeTopology], int]:
    """``(stages, topology, this rank's stage)``; one stage for ``None``, 1 or a single process."""
    if num_stages is None:
        return 1, None, 0
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r}: expected an integer >= 1 (or None for one stage)")
    if num_stages == 1:
        return 1, None, 0
    if not dist.is_initialized():
        init_distributed()  # from torchrun's environment; a lone process gets a 1-rank group
    world = dist.get_world_size()
    if world == 1:
        logger.info("PipelineModule: num_stages=%d on a single process: every layer runs on it (one stage)", num_stages)
        return 1, None, 0
    topology = PipeTopology.for_world(world, num_stages)
    return num_stages, topology, topology.stage_of(dist.get_rank())
