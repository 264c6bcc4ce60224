"""``zero.Init``: build a model already partitioned, one submodule at a time (docs/stage3.md, "zero.Init").

A module is partitioned the moment it is assigned to its parent (torch's module-registration hook runs after
its ``__init__`` returned); modules that never get a parent (the model itself) on exit.  So peak memory while
building is about one submodule, and each ``__init__`` runs on ordinary full tensors.  Values are taken from
rank 0 (one broadcast per module), as ``shardwise.initialize`` would make them.  An operation on an already
partitioned parameter inside the context runs on it gathered (a write: rank 0's result is re-partitioned);
``param.data`` keeps it gathered until the next submodule is registered or the context ends.  The two
registration hooks are removed on exit; nothing else in the process changes.
"""

from __future__ import annotations

import contextlib
import logging
from types import TracebackType
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules import module as module_hooks

from ...comm.distributed import Comm, init_distributed
from ...config import Config
from .params import Unit, gather_units, not_gathered_error, param_name, unit_of

__all__ = ["Init"]

_ALIASES = {"config_dict_or_path": "config", "data_parallel_group": "process_group"}
_IGNORED = {"pin_memory", "mem_efficient_linear", "dtype", "mpu"}
_REMOTE_DEVICES = (None, "none", "cpu", "nvme")
logger = logging.getLogger("shardwise")


def _remote_device_line(remote_device: Optional[str], config: Optional[Config]) -> Optional[str]:
    """What DeepSpeed's ``remote_device`` means here, or an error when the config cannot honour it.  Whatever it says,
    ``zero.Init`` builds this rank's shards in host memory; where they live for training is the config's
    ``offload_param`` (`initialize` writes them to NVMe when it says so).
    """
    if remote_device not in _REMOTE_DEVICES:
        raise ValueError(f"zero.Init: `remote_device={remote_device!r}`; expected one of 'none', 'cpu' or 'nvme' "
                         "(DeepSpeed's values); pass one of them or leave it out")
    section = config.zero_optimization.offload_param if config is not None else None
    device = section.device if section is not None else "none"
    if remote_device == "nvme" and device != "nvme":
        raise ValueError(
            f"zero.Init: `remote_device='nvme'` asks for the parameters on NVMe, but the config's "
            f"`zero_optimization.offload_param.device` is {device!r}"
            f"{'' if config is not None else ' (no config was passed)'}; add `offload_param: {{device: nvme, "
            "nvme_path: /local_nvme}` to the config passed as `config`, or pass `remote_device='cpu'`")
    if remote_device in (None, "none"):
        return None
    if remote_device == "nvme" and section is not None:
        return ("zero.Init(remote_device='nvme'): each rank's shards are built in host memory and stay there until "
                f"`initialize`, which moves them into files under {section.nvme_path!r} (`offload_param: nvme`; on a "
                "GPU job by way of the GPU, which holds this rank's fp32 shards until `initialize` has placed them)")
    return ("zero.Init(remote_device='cpu'): each rank's shards are built where the model makes its parameters "
            "(host memory unless torch's default device is set); `initialize` then places them as the config says "
            "(`offload_param: nvme`: in files; `cpu` on a GPU job: in host memory; otherwise on the job's device)")


class Init:
    """Context manager: modules constructed inside are partitioned for ZeRO stage 3 as they are built.

    ``config`` (dict, path or :class:`shardwise.Config`) must select ``zero_optimization.stage`` 3 when given;
    ``process_group`` must be the one later passed to ``shardwise.initialize``; ``enabled=False`` makes the context a
    no-op; ``module=`` partitions an existing module right away. DeepSpeed's ``config_dict_or_path`` and
    ``data_parallel_group`` are accepted as aliases; ``pin_memory``, ``mem_efficient_linear``, ``dtype`` and ``mpu`` are
    accepted and ignored (the engine casts to the config's dtype). ``remote_device`` (DeepSpeed's ``None``, ``'cpu'`` or
    ``'nvme'``): the shards are built in host memory whatever it says, and ``initialize`` puts them where the config's
    ``offload_param`` says (``'nvme'`` needs ``offload_param: {device: nvme}`` in ``config``, else it is an error); an
    info line says which.
    """

    def __init__(self, config: Any = None, process_group: Optional[dist.ProcessGroup] = None,
                 enabled: bool = True, module: Optional[nn.Module] = None, **kwargs: Any) -> None:
        options: dict[str, Any] = {"config": config, "process_group": process_group,
                                   "remote_device": kwargs.pop("remote_device", None)}
        for key, value in kwargs.items():
            if key in _ALIASES:
                options[_ALIASES[key]] = value
            elif key not in _IGNORED:
                known = sorted(["config", "process_group", "enabled", "module", "remote_device", *_ALIASES, *_IGNORED])
                raise TypeError(f"zero.Init got an unknown argument `{key}`; known arguments: {known}")
        self.enabled = enabled
        self.config = Config.load(options["config"]) if options["config"] is not None else None
        line = _remote_device_line(options["remote_device"], self.config) if enabled else None
        if self.config is not None and self.config.zero_optimization.stage != 3:
            raise ValueError(
                f"zero.Init partitions parameters for ZeRO stage 3, but the config has "
                f"`zero_optimization.stage` {self.config.zero_optimization.stage}; set it to 3, or build the "
                "model without `zero.Init`")
        self.process_group = options["process_group"]
        if line is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            logger.info(line)
        self.comm: Optional[Comm] = None
        self._active = False
        self._handles: list[Any] = []
        self._pending: dict[int, nn.Module] = {}
        self._dirty: list[Unit] = []
        if module is not None and enabled:
            self._start_comm()
            self._partition_tree(module)

    def _start_comm(self) -> Comm:
        if self.comm is None:
            if not dist.is_initialized():
                init_distributed()
            self.comm = Comm(self.process_group)
        return self.comm

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        self._start_comm()
        self._handles = [
            module_hooks.register_module_parameter_registration_hook(self._on_parameter),
            module_hooks.register_module_module_registration_hook(self._on_submodule),
        ]
        self._active = True
        return self

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        if not self.enabled:
            return
        for handle in self._handles:
            handle.remove()
        self._handles = []
        try:
            if exc_type is None:
                self._flush()
                for module in list(self._pending.values()):
                    self._partition_tree(module)
        finally:
            self._active, self._pending = False, {}

    def _on_parameter(self, module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        if param is not None and unit_of(param) is None:
            self._pending[id(module)] = module

    def _on_submodule(self, parent: nn.Module, name: str, child: Optional[nn.Module]) -> None:
        self._flush()
        if child is not None:
            self._partition_tree(child)

    def _partition_tree(self, root: nn.Module) -> None:
        comm = self._start_comm()
        for prefix, module in root.named_modules():
            self._pending.pop(id(module), None)
            by_dtype: dict[torch.dtype, tuple[list[nn.Parameter], list[str]]] = {}
            for name, param in module._parameters.items():
                if param is None or unit_of(param) is not None or not param.is_floating_point():
                    continue
                params, names = by_dtype.setdefault(param.dtype, ([], []))
                if any(p is param for p in params):
                    continue
                params.append(param)
                names.append(f"{type(root).__name__}.{prefix + '.' if prefix else ''}{name}")
            for dtype, (params, names) in by_dtype.items():
                unit = Unit(0, params, names, comm, self)
                flat = unit.flatten([p.detach() for p in params], dtype, params[0].device)
                comm.broadcast(flat, src=0)
                unit.build(flat, dtype)

    def _flush(self) -> None:
        """Re-partition units kept gathered for ``param.data`` reads, from rank 0's values."""
        dirty, self._dirty = self._dirty, []
        for unit in dirty:
            unit.scatter_from_full(src=0)
            self.release(unit)

    def needs(self, unit: Unit) -> bool:
        return not unit.gathered

    def on_demand(self, units: list[Unit], func: Any, mutating: bool) -> contextlib.AbstractContextManager[None]:
        if not self._active:
            param = next(p for u in units for p in u.params)
            raise not_gathered_error(param, func)
        return self._around(units, mutating)

    @contextlib.contextmanager
    def _around(self, units: list[Unit], mutating: bool) -> Iterator[None]:
        for unit in units:
            unit.acquire()
        try:
            gather_units(units)
            yield
            if mutating:
                for unit in units:
                    unit.scatter_from_full(src=0)
        finally:
            for unit in units:
                self.release(unit)

    def on_data_access(self, unit: Unit) -> None:
        if not self._active:
            raise not_gathered_error(unit.params[0], torch.Tensor.data)
        unit.acquire()
        unit.gather()
        self._dirty.append(unit)

    def on_cast(self, unit: Unit, device: Optional[torch.device], dtype: Optional[torch.dtype]) -> bool:
        if self._active:
            return False  # a value cast inside init code: gather and really cast
        unit.convert(device, dtype)  # `module.to(dtype)` after building: cast the partitions
        return True

    def release(self, unit: Unit) -> None:
        if unit.release() == 0:
            unit.free()

    def on_params_modified(self, unit: Unit) -> None:
        """Only the shard (and its fp32 ``pristine`` copy) hold a ``zero.Init`` unit's values."""
        unit.scatter_from_full()

    def on_values_loaded(self, unit: Unit, values: torch.Tensor, loaded: set[int]) -> None:
        """Nothing else holds copies of a ``zero.Init`` unit's values (its fp32 ``pristine`` followed)."""

    def on_traced_read(self, unit: Unit, param: torch.Tensor) -> None:
        """A compiled graph replays without asking again: a partitioned parameter never enters one here."""
        raise RuntimeError(
            f"rank {unit.comm.rank}: a compiled function reads parameter `{param_name(param)}`, which "
            "`zero.Init` partitioned, before `shardwise.initialize` wraps its model: nothing would gather it "
            "when the graph runs again. Run it eagerly, or compile the model and call it after "
            "`shardwise.initialize` (its hooks gather the parameters)")

    def on_gathered_data_access(self, unit: Unit) -> None:
        """A gathered unit here is held by an operation or a ``.data`` read that re-partitions it itself."""

    def on_write(self, unit: Unit) -> contextlib.AbstractContextManager[None]:
        """A write to a gathered unit is re-partitioned from rank 0 by the operation holding it."""
        return contextlib.nullcontext()
