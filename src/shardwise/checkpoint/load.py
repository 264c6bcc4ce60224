"""``load_checkpoint``: restore an engine from a checkpoint of any world size and ZeRO stage.

Each rank asks DCP for exactly the element ranges it owns *now* (its master
pieces, its optimizer-state pieces); DCP reads the overlap with whatever
ranges were saved.  Non-trainable entries are read whole on every rank.
Steps, each timeout-bounded and raised on every rank if any rank fails:
join (store) → read manifest and check completeness → plan → read (DCP) and
apply → re-gather parameters from the masters (collective).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .agreement import Session, join
from .codec import Decoder, refuse_pickles, tensor_refs
from .errors import CheckpointError
from .formats import foreign_format
from .layout import LATEST, MANIFEST, check_complete, list_checkpoints, read_rank_file, resolve
from .rng import restore_rng
from .stateful import ModelNames, ModelState, OptimizerState, Sources, TensorState
from .storage import LoadPlanner, SafeReader, dcp_errors

__all__ = ["load_checkpoint"]


def load_checkpoint(
    engine: Any,
    load_dir: Any,
    tag: Optional[str] = None,
    *,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    module_load_fn: Optional[Callable[[dict[str, torch.Tensor], Any], Any]] = None,
    strict: bool = True,
) -> tuple[Optional[str], Optional[dict[str, Any]]]:
    """Collectively restore ``engine`` from ``load_dir/tag`` (``tag=None``: the one ``latest`` names).

    Returns ``(path of the checkpoint loaded, the client_state given to
    save_checkpoint)``, or ``(None, None)`` with a warning when ``tag`` is None
    and ``load_dir`` holds no complete checkpoint.  See ``docs/checkpoints.md``
    for what each option restores.
    """
    config = engine.config.checkpoint
    payload = {"op": "load_checkpoint", "dir": str(Path(load_dir).absolute()), "tag": tag}
    session = join(engine.comm, "load_checkpoint", payload, config.timeout)
    session.require_same("op", "checkpoint operations", "call `load_checkpoint` on every rank at the same point")
    session.require_same("dir", "directories", "pass the same `load_dir` on every rank")
    session.require_same("tag", "tags", "pass the same `tag=` on every rank (or none, for `latest`)")
    if _agree_nothing_to_load(session, Path(load_dir), tag):
        warnings.warn(
            f"load_checkpoint: {Path(load_dir).absolute()} holds no complete checkpoint (no `{LATEST}` file "
            "and no tag directory); nothing was loaded and (None, None) is returned",
            stacklevel=3,
        )
        return None, None
    options = _Options(load_optimizer_states, load_lr_scheduler_states, load_module_only, module_load_fn, strict)
    wanted = _names_with_saved_state(Path(load_dir), tag)
    with engine.strategy.checkpoint_view(loading=True, wanted=wanted):
        return _Load(engine, session, Path(load_dir), tag, options).run()


def _nothing_to_load(load_dir: Path, tag: Optional[str]) -> bool:
    """No tag asked for, and the directory has neither `latest` nor any complete checkpoint."""
    if tag is not None:
        return False
    if (load_dir / LATEST).is_file() or (load_dir / MANIFEST).is_file() or foreign_format(load_dir) is not None:
        return False  # (another format is named by the load's error)
    return not any(committed for _, _, committed in list_checkpoints(load_dir))


def _agree_nothing_to_load(session: Session, load_dir: Path, tag: Optional[str]) -> bool:
    """Every rank's view of "is there a checkpoint?", which must agree (a shared directory)."""
    _, views = session.step("looking for a checkpoint", lambda: _nothing_to_load(load_dir, tag), share=True)
    if any(v != views[0] for v in views):
        raise CheckpointError(
            f"rank {session.rank}: ranks disagree on whether {load_dir} holds a checkpoint "
            f"({', '.join(f'rank {r}: {not v}' for r, v in enumerate(views))}); `load_dir` must be one "
            "directory shared by all ranks"
        )
    return bool(views[0])


def _names_with_saved_state(load_dir: Path, tag: Optional[str]) -> frozenset[str]:
    """Parameters the checkpoint has optimizer state for (a frozen one keeps it for later).

    Any problem reading the manifest is left to the load itself to report.
    """
    try:
        manifest = check_complete(resolve(load_dir, tag))
    except Exception:
        return frozenset()
    return frozenset(((manifest.get("optimizer") or {}).get("state") or {}).keys())


class _Options:
    def __init__(self, optimizer: bool, scheduler: bool, module_only: bool, module_load_fn: Any, strict: bool) -> None:
        self.optimizer = optimizer and not module_only
        self.scheduler = scheduler and not module_only
        self.module_only = module_only
        self.module_load_fn = module_load_fn
        self.strict = strict


class _Load:
    """One load, step by step; see the module docstring."""

    def __init__(self, engine: Any, session: Session, load_dir: Path, tag: Optional[str], options: _Options) -> None:
        self.engine = engine
        self.session = session
        self.load_dir = load_dir
        self.tag = tag
        self.options = options
        self.rank = engine.comm.rank
        self.allow_pickle = engine.config.checkpoint.allow_pickle
        self.shards = engine.strategy.param_shards()
        self.inner = engine.optimizer.inner if engine.optimizer is not None else None
        self.optimizer_state = getattr(self.inner, "state", None)
        self.manifest: dict[str, Any] = {}
        self.path = Path()
        self.extra: dict[str, torch.Tensor] = {}
        self.rng: Optional[tuple[Any, dict[str, torch.Tensor]]] = None
        self.client_state: dict[str, Any] = {}

    def run(self) -> tuple[Optional[str], Optional[dict[str, Any]]]:
        _, found = self.session.step("reading the checkpoint manifest", self._read_manifest, share=True)
        paths = [f["path"] for f in found]
        if any(p != paths[0] for p in paths):
            raise CheckpointError(
                f"rank {self.rank}: the ranks resolved different checkpoints ({paths}); `latest` changed while "
                "they read it, or the directory is not shared: pass an explicit `tag=`"
            )
        trainable = {name: shape for f in found for name, shape in f["trainable"].items()}
        states, _ = self.session.step("planning the load", lambda: self._plan(trainable))
        self.session.step("reading its shards", lambda: self._read(states))
        # Collective work (stage 3 partitioned entries), once every rank has read successfully.
        for state in states.values():
            for action in state.finalize:
                action()
        self.engine.strategy.sync_params_from_master()
        return str(self.path), self.client_state

    # ------------------------------------------------------------ steps
    def _read_manifest(self) -> dict[str, Any]:
        self.path = resolve(self.load_dir, self.tag).absolute()
        self.manifest = check_complete(self.path)
        trainable = {s.name: list(s.shape) for s in self.shards}
        return {"path": str(self.path), "trainable": trainable}

    def _plan(self, trainable: dict[str, list[int]]) -> dict[str, TensorState]:
        for part in ("client_state", "scheduler", "precision"):
            refuse_pickles(self.manifest.get(part), part, self.allow_pickle)
        refuse_pickles(self.manifest.get("optimizer"), "optimizer", self.allow_pickle)
        module = self.engine.module
        if self.options.module_load_fn is not None:
            model = ModelState.for_module_load_fn(module, self.shards, self.manifest, self.options.module_load_fn)
        else:
            names = ModelNames.of(module)
            self._check_keys(names, trainable)
            model = ModelState.loading(names, self.shards, self.manifest, set(trainable))
        states: dict[str, TensorState] = {"model": model}
        saved_optimizer = self.manifest.get("optimizer")
        if self.options.optimizer and self.inner is not None and saved_optimizer is not None:
            self._check_groups(saved_optimizer)
            if self.optimizer_state is not None:
                aliases = self.manifest["aliases"]
                states["optim"] = OptimizerState.loading(self.optimizer_state, self.shards, saved_optimizer["state"], aliases)
        states["extra"] = TensorState(dict(self._buffers(self.manifest, self.extra)))
        rng = self._rng_plan()
        if rng is not None:
            refuse_pickles(rng[0], "RNG state", self.allow_pickle)
            states["rng"] = TensorState(dict(rng[1]))
            self.rng = rng
        return states

    def _read(self, states: dict[str, TensorState]) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        reader = SafeReader(self.path)
        group = self.engine.comm.group
        with dcp_errors(self.path):
            dcp.load(states, storage_reader=reader, planner=LoadPlanner(), process_group=group, no_dist=not distributed)
        self._apply()

    # ------------------------------------------------------------ checks
    def _check_keys(self, names: ModelNames, trainable: dict[str, list[int]]) -> None:
        missing, unexpected, mismatched = Sources(self.manifest).report(names, trainable)
        if mismatched:
            raise CheckpointError(f"checkpoint {self.path} does not fit this model: size mismatch for {mismatched}")
        if not (missing or unexpected):
            return
        detail = (
            f"missing keys (in the model, not the checkpoint): {missing}; "
            f"unexpected keys (in the checkpoint, not the model): {unexpected}"
        )
        if self.options.strict:
            raise CheckpointError(
                f"checkpoint {self.path} does not match this model: {detail}. Pass `strict=False` to load the "
                "entries both have, or `module_load_fn=` to map them yourself"
            )
        warnings.warn(f"load_checkpoint(strict=False) from {self.path}: {detail}", stacklevel=4)

    def _check_groups(self, saved_optimizer: dict[str, Any]) -> None:
        saved = saved_optimizer.get("param_groups") or []
        if len(saved) != len(self.inner.param_groups):
            raise CheckpointError(
                f"the checkpoint's optimizer has {len(saved)} param group(s), this one {len(self.inner.param_groups)}; "
                "build the optimizer with the same param groups, or pass `load_optimizer_states=False`"
            )

    # ------------------------------------------------------------ buffers
    def _buffers(self, encoded: Any, into: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for ref in tensor_refs(encoded):
            into[ref["__tensor__"]] = torch.empty(ref["shape"], dtype=getattr(torch, ref["dtype"]))
        return into

    def _rng_plan(self) -> Optional[tuple[Any, dict[str, torch.Tensor]]]:
        config = self.engine.config.checkpoint
        if self.options.module_only or not config.save_rng_state or not self.manifest.get("rng"):
            return None
        if self.manifest["world_size"] != self.engine.comm.world_size:
            return None  # a rank's RNG stream has no counterpart at another world size
        encoded = read_rank_file(self.path, self.rank, self.manifest["world_size"]).get("rng")
        if encoded is None:
            return None
        return encoded, self._buffers(encoded, {})

    # ------------------------------------------------------------ apply
    def _apply(self) -> None:
        decoder = Decoder(self.extra, self.allow_pickle)
        self.client_state = decoder.decode(self.manifest["client_state"], "client_state")
        engine, manifest = self.engine, self.manifest
        if self.options.optimizer and self.inner is not None and manifest.get("optimizer"):
            groups = decoder.decode(manifest["optimizer"]["param_groups"], "optimizer param_groups")
            for group, saved in zip(self.inner.param_groups, groups):
                group.update({k: v for k, v in saved.items() if k != "params"})
        if self.options.scheduler and manifest.get("scheduler") is not None:
            if engine.lr_scheduler is None:
                warnings.warn(f"checkpoint {self.path} has lr scheduler state but this engine has no scheduler", stacklevel=5)
            else:
                engine.lr_scheduler.load_state_dict(decoder.decode(manifest["scheduler"], "lr_scheduler state"))
        if not self.options.module_only:
            self._apply_precision(decoder.decode(manifest["precision"], "precision state"))
            for key, value in manifest["counters"].items():
                setattr(engine, key, int(value))
        if self.rng is not None:
            restore_rng(Decoder(self.rng[1], self.allow_pickle).decode(self.rng[0], "RNG state"))

    def _apply_precision(self, state: dict[str, Any]) -> None:
        current = str(self.engine.precision.dtype).replace("torch.", "")
        if state.get("dtype") == current:
            self.engine.precision.load_state_dict(state)
        elif state.get("dtype") == "float16" or current == "float16":
            warnings.warn(
                f"checkpoint {self.path} was trained in {state.get('dtype')}, this engine runs in {current}: "
                "the loss scaler starts fresh",
                stacklevel=5,
            )
