"""``ShardwiseStrategy``: Lightning's Trainer training through a shardwise engine.

Lightning's ``DDPStrategy`` for everything about processes (launch, environment, ``reduce``/``barrier``/
``broadcast``), handing the model to :func:`shardwise.initialize` at ``setup``.  Lightning runs the loop through the
engine's forward, ``no_sync`` and step, and steps its LR schedulers on the user's optimizer (:mod:`.groups`).
Checkpoints are the engine's, with Lightning's state as its ``client_state`` (docs/lightning.md, "Checkpoints").  The
class is built once per Lightning package (:mod:`.flavour`).
"""

from __future__ import annotations

import contextlib
import functools
from abc import ABCMeta
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch

import shardwise
from shardwise.config import Config
from shardwise.engine.engine import Engine
from shardwise.optim.optimizers import build_optimizer
from shardwise.optim.schedulers import build_scheduler

from . import flavour as flavours
from .config import PRECISIONS, ConfigSource, StrategyConfig, TrainerFacts
from .groups import GroupBridge
from .precision import ShardwisePrecision, as_shardwise, precision_class

__all__ = ["CHECKPOINT_TAG", "ShardwiseStrategy", "strategy_class"]

#: the tag of the checkpoint inside the directory ``trainer.save_checkpoint(path)`` writes (DeepSpeedStrategy's)
CHECKPOINT_TAG = "checkpoint"

#: the names ``Trainer(strategy="...")`` accepts once ``shardwise.lightning`` is imported, as DeepSpeed's
REGISTERED: dict[str, dict[str, Any]] = {
    "shardwise": {},
    "shardwise_stage_0": {"stage": 0},
    "shardwise_stage_1": {"stage": 1},
    "shardwise_stage_2": {"stage": 2},
    "shardwise_stage_2_offload": {"stage": 2, "offload_optimizer": True},
    "shardwise_stage_3": {"stage": 3},
    "shardwise_stage_3_offload": {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
}

if TYPE_CHECKING:
    _Base = Any  # at run time the Lightning package's DDPStrategy, joined in by `strategy_class`
else:
    _Base = object


class _PackageChooser(ABCMeta):
    """``ShardwiseStrategy(...)`` builds the strategy for the Lightning package the program uses."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is ShardwiseStrategy:
            return strategy_class(flavours.load(flavours.chosen()))(*args, **kwargs)
        return super().__call__(*args, **kwargs)


class ShardwiseStrategy(_Base, metaclass=_PackageChooser):
    """Train with a shardwise engine under ``lightning.pytorch.Trainer`` (or ``pytorch_lightning``'s).

    ``config`` is a DeepSpeed config (dict or path); the other arguments fill in what it leaves unsaid and must not
    contradict it (each against ``DeepSpeedStrategy``'s: docs/lightning.md, "Arguments").  After ``fit`` has set up,
    ``trainer.strategy.engine`` is the :class:`shardwise.Engine`.
    """

    strategy_name = "shardwise"
    _flavour: flavours.Flavour

    def __init__(self, config: ConfigSource = None, stage: Optional[int] = None, offload_optimizer: bool = False,
                 offload_parameters: bool = False, offload_optimizer_device: str = "cpu",
                 offload_params_device: str = "cpu", nvme_path: str = "/local_nvme", loss_scale: Optional[float] = None,
                 initial_scale_power: Optional[int] = None, loss_scale_window: Optional[int] = None,
                 hysteresis: Optional[int] = None, min_loss_scale: Optional[float] = None, accelerator: Any = None,
                 parallel_devices: Optional[list[Any]] = None, cluster_environment: Any = None,
                 precision_plugin: Any = None, process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = None) -> None:
        extra = {"timeout": timeout} if timeout is not None else {}
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, **extra)
        offload = {}
        if offload_optimizer:
            offload["offload_optimizer"] = _offload_section(offload_optimizer_device, nvme_path)
        if offload_parameters:
            offload["offload_param"] = _offload_section(offload_params_device, nvme_path)
        self._source = StrategyConfig.from_arguments(config, stage, offload, {
            "loss_scale": loss_scale, "initial_scale_power": initial_scale_power,
            "loss_scale_window": loss_scale_window, "hysteresis": hysteresis, "min_loss_scale": min_loss_scale})
        self._engine: Optional[Engine] = None
        self._bridge: Optional[GroupBridge] = None
        #: the last `load_checkpoint` read a file (weights to load), not a checkpoint directory
        self._from_file = False
        #: `configure_model` built the model partitioned (the engine places those parameters itself)
        self._built_partitioned = False

    @classmethod
    def built_for(cls, package: str) -> type:
        """The strategy class for the Lightning package ``package`` (``"lightning.pytorch"`` or ``"pytorch_lightning"``)."""
        return strategy_class(flavours.load(package))

    # ----------------------------------------------------------------- the engine
    @property
    def engine(self) -> Engine:
        """The :class:`shardwise.Engine` of the current (or last) ``fit``/``validate``/``test``/``predict``."""
        if self._engine is None:
            raise RuntimeError("ShardwiseStrategy has no engine yet: it is built when `trainer.fit` (or validate, "
                               "test, predict) sets up; call this from a hook or after that call")
        return self._engine

    @property
    def stage(self) -> int:
        """The ZeRO stage the engine runs (the config's, or the ``stage`` argument)."""
        return self._source.stage

    @property
    def precision_plugin(self) -> Any:
        plugin = getattr(self, "_precision_plugin", None)
        return plugin if plugin is not None else precision_class(self._flavour)()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Any) -> None:
        # The Trainer hands over the plugin it chose for `precision=...`: its flag is what the engine needs
        self._precision_plugin = as_shardwise(self._flavour, plugin)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine, built in `setup`, reads its checkpoint

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine's checkpoint holds the optimizer state

    def setup(self, trainer: Any) -> None:
        """Build the engine: a training one when fitting, else an inference one (collective)."""
        self._release_engine()
        plugin: ShardwisePrecision = self.precision_plugin
        module = self.lightning_module
        fitting = trainer.state.fn == self._flavour.TrainerFn.FITTING
        refuse_unsupported(self._flavour, trainer, module, plugin.precision, plugin.chosen_by, fitting)
        self.accelerator.setup(trainer)
        if self.root_device.type != "cpu" and not self._built_partitioned:
            module.to(self.root_device)  # parameters `zero.Init` partitioned are placed by the engine
        self._built_partitioned = False
        facts = TrainerFacts(plugin.precision, trainer.accumulate_grad_batches, trainer.gradient_clip_val,
                             self.world_size)
        config = self._source.for_run(facts)
        if fitting:
            if self._layer_sync is not None:
                module = self._layer_sync.apply(module)
            self._setup_training(trainer, module, config)
        else:
            self._engine = shardwise.initialize(module, config=config.replace(optimizer=None, scheduler=None))
        self.model = self._engine

    def _setup_training(self, trainer: Any, module: Any, config: Config) -> None:
        config, optimizer, schedulers = self._optimizer_and_schedulers(trainer, module, config)
        self._bridge = GroupBridge(optimizer, module)
        self._engine = shardwise.initialize(module, optimizer=self._bridge.engine_optimizer, config=config)
        if not module.automatic_optimization:
            # several `manual_backward` calls before one `opt.step()` add up, as they do under DDP
            self._engine.accumulates_backwards = True
        self.optimizers = [optimizer]
        self.lr_scheduler_configs = schedulers

    def _optimizer_and_schedulers(self, trainer: Any, module: Any, config: Config) -> tuple[Config, Any, list[Any]]:
        """The user's optimizer and LR schedulers, for Lightning to step, and the engine's config without them: from
        ``configure_optimizers``, or the config's sections as DeepSpeedStrategy builds them (docs/lightning.md, "What a
        LightningModule can use"); a section with values of its own next to ``configure_optimizers``' is an error."""
        flavour = self._flavour
        optimizers, schedulers = flavour.init_optimizers(module)
        optimizer = single_optimizer(optimizers, schedulers)
        total = trainer.estimated_stepping_batches if config.scheduler is not None else None
        resolved = config.resolve(
            world_size=self.world_size, model=module, optimizer=optimizer,
            lr_scheduler=schedulers[0].scheduler if schedulers else None,
            total_num_steps=int(total) if total is not None and total != float("inf") else None)
        if resolved.optimizer is not None:
            if optimizer is not None:
                raise ValueError("the strategy's config has an `optimizer` section and `configure_optimizers` returns "
                                 "an optimizer; keep one of them")
            optimizer = build_optimizer(resolved.optimizer, [p for p in module.parameters() if p.requires_grad])
        if optimizer is None:
            raise ValueError("`configure_optimizers` returned no optimizer and the strategy's config has no `optimizer` "
                             "section; `fit` needs one of them")
        if resolved.scheduler is not None:
            if schedulers:
                raise ValueError("the strategy's config has a `scheduler` section and `configure_optimizers` returns "
                                 "an LR scheduler; keep one of them")
            schedulers = [flavour.LRSchedulerConfig(build_scheduler(resolved.scheduler, optimizer), interval="step")]
        # the engine resolves its own copy (resolving twice would mark every default as set by the user)
        return config.replace(optimizer=None, scheduler=None), optimizer, schedulers

    def _release_engine(self) -> None:
        """Give the module back as a plain one (stage 3: full parameters again; collective)."""
        if self._engine is not None:
            self._engine.destroy()
        self._engine, self._bridge = None, None

    def teardown(self) -> None:
        """Leave the engine in place, as DeepSpeedStrategy does, so ``trainer.save_checkpoint`` works after ``fit``;
        the next ``fit``/``validate``/``test``/``predict`` releases it before building its own."""
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # ------------------------------------------------------- backward and step
    def step_engine(self) -> bool:
        """The optimizer step Lightning asked for: the user's hyperparameters in, then ``engine.step()``."""
        self._push_hyperparameters()
        applied = self.engine.step()
        if applied and self._bridge is not None:
            self._bridge.stepped()
        return applied

    def _push_hyperparameters(self) -> None:
        engine = self.engine
        if self._bridge is not None and engine.optimizer is not None:
            self._bridge.push(engine.optimizer.param_groups)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning's accumulation: the backwards before its boundary accumulate without communication."""
        with self.engine.no_sync():
            yield

    def pre_backward(self, closure_loss: Any) -> None:
        """Nothing: the engine prepares its own backward."""

    def post_backward(self, closure_loss: Any) -> None:
        """Nothing: the engine finishes its own backward."""

    # ------------------------------------------------------------- checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the engine's checkpoint holds the weights (sharded; no gather here)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # the engine's checkpoint holds the optimizer state (sharded)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write the engine's checkpoint directory at ``filepath`` (every rank; collective), with Lightning's state
        as its ``client_state``. No Lightning collective runs first: a call on some ranks only fails, naming the
        ranks that did not come, within ``checkpoint.timeout``."""
        if storage_options is not None:
            raise TypeError("`Trainer.save_checkpoint(..., storage_options=...)` is not supported by ShardwiseStrategy: "
                            "the engine writes the checkpoint itself, not a `CheckpointIO` plugin")
        client_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        self._push_hyperparameters()  # the user's current lr is what a resume must start from
        self.engine.save_checkpoint(str(filepath), tag=CHECKPOINT_TAG, client_state=client_state)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A checkpoint directory: the engine restores it (weights, and when fitting the optimizer) and Lightning's
        state comes back. A file (a consolidated ``.ckpt``): read for ``validate``/``test``/``predict``."""
        path = Path(checkpoint_path)
        fitting = self.lightning_module.trainer.state.fn == self._flavour.TrainerFn.FITTING
        if not path.is_dir():
            if fitting:
                raise ValueError(
                    f"`fit(ckpt_path={str(path)!r})`: ShardwiseStrategy resumes from the checkpoint directory "
                    "`trainer.save_checkpoint` wrote; to start training from a file of weights, load it into the "
                    "model before `fit` (`model.load_state_dict(torch.load(path)['state_dict'])`)")
            self._from_file = True
            return dict(super().load_checkpoint(checkpoint_path, weights_only))
        self._from_file = False
        loaded, client_state = self.engine.load_checkpoint(
            str(path), load_optimizer_states=fitting, load_lr_scheduler_states=fitting,
            strict=self.lightning_module.strict_loading)
        if loaded is None or client_state is None:
            raise FileNotFoundError(f"{path} holds no shardwise checkpoint; pass a directory "
                                    "`trainer.save_checkpoint` wrote with ShardwiseStrategy")
        if fitting and self._bridge is not None and self.engine.optimizer is not None:
            self._bridge.pull(self.engine.optimizer.param_groups)
        return dict(client_state)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """A checkpoint directory's weights are loaded already; a file's go in unit by unit (collective)."""
        if self._from_file:
            shardwise.zero.load_state_dict(self.lightning_module, checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Nothing: the engine restored the optimizer from its checkpoint."""

    # ------------------------------------------------------------ construction
    @contextlib.contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        """Around ``configure_model``: at stage 3 the model is built already partitioned (``shardwise.zero.Init``)."""
        if self.stage != 3:
            yield
            return
        with shardwise.zero.Init(config=self._source.base()):
            yield
        self._built_partitioned = True


def _offload_section(device: str, nvme_path: str) -> dict[str, Any]:
    return {"device": device, **({"nvme_path": nvme_path} if device == "nvme" else {})}


@functools.cache
def strategy_class(flavour: flavours.Flavour) -> type:
    """:class:`ShardwiseStrategy` on ``flavour``'s ``DDPStrategy``, with its names in ``flavour``'s registry."""
    built = _PackageChooser("ShardwiseStrategy", (ShardwiseStrategy, flavour.DDPStrategy),
                            {"__module__": __name__, "_flavour": flavour, "__doc__": ShardwiseStrategy.__doc__})
    registry = flavour.StrategyRegistry
    for name, arguments in REGISTERED.items():
        if name not in registry:
            registry.register(name, built, description=f"shardwise engine {arguments or ''}".rstrip(), **arguments)
    return built


# ------------------------------------------------ what the strategy refuses at `setup`
# Lightning features it would otherwise carry out differently: each refusal names the feature and what to do
# instead; none is a silent difference.
def refuse_unsupported(flavour: flavours.Flavour, trainer: Any, module: Any, precision: str, chosen_by: str,
                       fitting: bool) -> None:
    """Raise for the first Lightning feature of this run the strategy does not carry out as Lightning would
    (outside ``fit``, only the precision matters)."""
    overridden = flavour.is_overridden
    if precision not in PRECISIONS:
        by = f" (the plugin `{chosen_by}`)" if chosen_by else ""
        raise ValueError(f"ShardwiseStrategy does not support `precision={precision!r}`{by}; use one of "
                         f"{sorted(PRECISIONS)}")
    if not fitting:
        return
    if overridden("backward", module, flavour.LightningModule):
        raise ValueError("`LightningModule.backward` is overridden, but ShardwiseStrategy runs the backward in the "
                         "engine (loss scaling, gradient reduction); remove the override and put extra work in "
                         "`on_before_backward` / `on_after_backward`")
    if overridden("configure_gradient_clipping", module, flavour.LightningModule):
        raise ValueError("`configure_gradient_clipping` is overridden, but the engine clips the reduced gradients "
                         "itself, by global norm; remove the override and set `Trainer(gradient_clip_val=...)`")
    algorithm = getattr(trainer, "gradient_clip_algorithm", None)
    if getattr(algorithm, "value", algorithm) == "value":
        raise ValueError("`Trainer(gradient_clip_algorithm='value')`: the engine clips by global norm only (as "
                         "DeepSpeedStrategy); use `gradient_clip_algorithm='norm'`")


def single_optimizer(optimizers: list[Any], schedulers: list[Any]) -> Any:
    """The one optimizer ``configure_optimizers`` returned (its schedulers must act on it), or None when it returned
    none (the config's ``optimizer`` section may give one, as for DeepSpeedStrategy)."""
    if len(optimizers) == 1 and type(optimizers[0]).__name__ == "_MockOptimizer":
        return None
    if len(optimizers) != 1:
        raise ValueError(f"`configure_optimizers` returned {len(optimizers)} optimizers; ShardwiseStrategy trains "
                         "with one (use param groups for different settings, or DDPStrategy for several optimizers)")
    optimizer = optimizers[0]
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("LBFGS evaluates its closure several times per step, which ShardwiseStrategy (as "
                         "DeepSpeedStrategy) does not support; use another optimizer")
    for config in schedulers:
        if getattr(config.scheduler, "optimizer", optimizer) is not optimizer:
            raise ValueError("an LR scheduler from `configure_optimizers` acts on another optimizer than the one "
                             "returned; build it on that optimizer")
    return optimizer
