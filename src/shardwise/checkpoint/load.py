"""``load_checkpoint``: restore an engine from a checkpoint of any world size and ZeRO stage.

Each rank asks DCP for the element ranges it owns *now*; DCP reads the overlap with whatever ranges were saved.
Nothing is applied until every rank has read and checked everything (``docs/checkpoints.md``).  Steps, each
timeout-bounded and raised on every rank: join → read the manifest → plan → read (DCP), decode and check → apply
(module entries, collective where partitioned; masters, optimizer state, hyperparameters, scheduler, loss scaler,
counters, RNG) → re-gather.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed.checkpoint as dcp

from ..comm.agreement import Session, join
from ..optim.param_state import ParamShard
from .codec import Decoder, empty_tensors, refuse_pickles
from .deepspeed_load import load_deepspeed
from .files import CheckpointError, expected_digests
from .layout import LATEST, MANIFEST, find_deepspeed, holds_none, member_path, rank_file, resolve
from .protocol import Apply, Checkpointable
from .stateful import ModelNames, ModelState, OptimizerState, Sources, TensorState, capture_rng, dtype_name, restore_rng
from .storage import LoadPlanner, SafeReader, dcp_errors
from .validate import check_complete, conform, read_rank_file

__all__ = ["load_checkpoint"]

#: what an lr scheduler writes into the optimizer's param groups (torch's `LRScheduler`, shardwise's schedules)
SCHEDULER_KEYS = frozenset({"initial_lr"})

ModuleLoadFn = Callable[[dict[str, torch.Tensor], Any], Any]


def load_checkpoint(
    engine: Checkpointable,
    load_dir: Any,
    tag: Optional[str] = None,
    *,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    module_load_fn: Optional[ModuleLoadFn] = None,
    strict: bool = True,
    member: Optional[str] = None,
) -> tuple[Optional[str], Optional[dict[str, Any]]]:
    """Collectively restore ``engine`` from ``load_dir/tag`` (``tag=None``: the one ``latest`` names).

    Returns ``(path of the checkpoint loaded, the client_state given to save_checkpoint)``, or ``(None, None)`` with a
    warning when ``tag`` is None and ``load_dir`` holds no complete checkpoint.  See ``docs/checkpoints.md`` for what
    each option restores.  In a checkpoint of several engines, the engine's files are ``TAG/<member>/`` (``member``
    defaults to the engine's name).
    """
    member = member if member is not None else engine.name
    load_dir = Path(load_dir)
    payload = {"op": "load_checkpoint", "dir": str(load_dir.absolute()), "tag": tag}
    session = join(engine.comm, "load_checkpoint", payload, engine.settings.timeout)
    session.require_same("op", "checkpoint operations", "call `load_checkpoint` on every rank at the same point")
    session.require_same("dir", "directories", "pass the same `load_dir` on every rank")
    session.require_same("tag", "tags", "pass the same `tag=` on every rank (or none, for `latest`)")
    nothing = _agreed(session, "looking for a checkpoint", lambda: tag is None and holds_none(load_dir), lambda views: (
        f"ranks disagree on whether {load_dir} holds a checkpoint "
        f"({', '.join(f'rank {r}: {not v}' for r, v in enumerate(views))}); `load_dir` must be one "
        "directory shared by all ranks"))
    if nothing:
        warnings.warn(
            f"load_checkpoint: {load_dir.absolute()} holds no complete checkpoint (no `{LATEST}` file "
            "and no tag directory); nothing was loaded and (None, None) is returned",
            stacklevel=3,
        )
        return None, None
    options = _Options(load_optimizer_states, load_lr_scheduler_states, load_module_only, module_load_fn, strict)
    found = lambda: None if (at := find_deepspeed(load_dir, tag)) is None else str(at.absolute())  # noqa: E731
    deepspeed = _agreed(session, "looking for a DeepSpeed checkpoint", found,
                        lambda views: f"ranks found different DeepSpeed checkpoints in {load_dir} ({views}); `load_dir` "
                        "must be one directory shared by all ranks, and `latest` must not change during the load")
    if deepspeed is not None:  # a foreign format, recognised by its file names: no manifest, no checksums
        return load_deepspeed(engine, session, Path(deepspeed), options)
    try:  # parameters the checkpoint has optimizer state for (a frozen one keeps it); the load reports any problem
        manifest = check_complete(_find(load_dir, tag, member))
        wanted = frozenset(((manifest.get("optimizer") or {}).get("state") or {}).keys())
    except Exception:  # noqa: BLE001 - the load reports it, with context
        wanted = frozenset()
    with engine.shards(loading=True, wanted=wanted) as shards:
        result = _Load(engine, shards, session, load_dir, tag, member, options).run()
    engine.after_load()
    return result


def _agreed(session: Session, what: str, look: Callable[[], Any], differ: Callable[[list[Any]], str]) -> Any:
    """What ``look`` sees, which must be the same on every rank (a shared directory); else ``differ(views)``."""
    _, views = session.step(what, look, share=True)
    if any(v != views[0] for v in views):
        raise CheckpointError(f"rank {session.rank}: {differ(views)}")
    return views[0]


def _find(load_dir: Path, tag: Optional[str], member: Optional[str]) -> Path:
    """The directory of this engine's checkpoint (its own subdirectory in a checkpoint of several)."""
    return member_path(resolve(load_dir, tag), member)


class _Options:
    def __init__(self, optimizer: bool, scheduler: bool, module_only: bool, module_load_fn: Any, strict: bool) -> None:
        self.optimizer, self.scheduler = optimizer and not module_only, scheduler and not module_only
        self.module_only, self.module_load_fn, self.strict = module_only, module_load_fn, strict


@dataclass
class _Decoded:
    """Every non-tensor part of the checkpoint, decoded and checked, ready to apply."""

    client_state: dict[str, Any] = field(default_factory=dict)
    param_groups: Optional[list[dict[str, Any]]] = None
    extras: dict[str, dict[str, Any]] = field(default_factory=dict)
    rng: Optional[dict[str, Any]] = None


class _Load:
    """One load, step by step; see the module docstring."""

    def __init__(self, engine: Checkpointable, shards: list[ParamShard], session: Session, load_dir: Path,
                 tag: Optional[str], member: Optional[str], options: _Options) -> None:
        self.engine, self.shards, self.session, self.options = engine, shards, session, options
        self.load_dir, self.tag, self.member = load_dir, tag, member
        self.rank = engine.comm.rank
        self.allow_pickle = engine.settings.allow_pickle
        self.manifest: dict[str, Any] = {}
        self.path = Path()
        self.extra: dict[str, torch.Tensor] = {}
        self.rng: Optional[tuple[Any, dict[str, torch.Tensor]]] = None
        self.apply_entries: Apply = lambda: None
        self.decoded = _Decoded()

    def run(self) -> tuple[Optional[str], Optional[dict[str, Any]]]:
        _, found = self.session.step("reading the checkpoint manifest", self._read_manifest, share=True)
        paths = [f["path"] for f in found]
        if any(p != paths[0] for p in paths):
            raise CheckpointError(
                f"rank {self.rank}: the ranks resolved different checkpoints ({paths}); `latest` changed while "
                "they read it, or the directory is not shared: pass an explicit `tag=`"
            )
        with_master = {name: shape for f in found for name, shape in f["with_master"].items()}
        states, _ = self.session.step("planning the load", lambda: self._plan(with_master))
        self.session.step("reading and checking its shards", lambda: self._read(states))
        # Every rank has read and checked everything: apply, the states' actions first, since one may fill a module
        # entry's buffer from a saved master that the engine's entries (collective where partitioned) then install.
        for state in states.values():
            state.apply()
        self.apply_entries()
        decoded, extras, optimizer = self.decoded, self.engine.extras(), self.engine.optimizer
        if decoded.param_groups is not None and optimizer is not None:
            for group, saved in zip(optimizer.param_groups, decoded.param_groups):
                group.update(saved)
        for name, values in decoded.extras.items():
            extras[name].load_state_dict(values)
        if decoded.rng is not None:
            restore_rng(decoded.rng)
        return str(self.path), decoded.client_state

    def _read_manifest(self) -> dict[str, Any]:
        self.path = _find(self.load_dir, self.tag, self.member).absolute()
        self.manifest = check_complete(self.path)
        with_master = {s.name: list(s.shape) for s in self.shards}
        return {"path": str(self.path), "with_master": with_master}

    def _plan(self, with_master: dict[str, list[int]]) -> dict[str, TensorState]:
        for part in ("client_state", "scheduler", "precision", "optimizer"):
            refuse_pickles(self.manifest.get(part), part, self.allow_pickle)
        if self.options.module_load_fn is not None:
            model = self._plan_module_load_fn()
        else:
            names = ModelNames.of(self.engine.module)
            self._check_keys(names, with_master)
            sources = Sources(self.manifest)
            present = [n for n in names.others(set(with_master)) if sources.find(n) is not None]
            buffers, self.apply_entries = self.engine.load_entries(names.live(present))
            model = ModelState.loading(self.shards, sources, buffers)
        states: dict[str, TensorState] = {"model": model}
        saved_optimizer = self.manifest.get("optimizer")
        if self.options.optimizer and self.engine.optimizer is not None and saved_optimizer is not None:
            saved, groups = saved_optimizer.get("param_groups") or [], self.engine.optimizer.param_groups
            if len(saved) != len(groups):
                raise CheckpointError(
                    f"the checkpoint's optimizer has {len(saved)} param group(s), this one {len(groups)}; "
                    "build the optimizer with the same param groups, or pass `load_optimizer_states=False`"
                )
            states["optim"] = OptimizerState.loading(self.shards, saved_optimizer["state"], self.manifest["aliases"])
        described = {k: v for k, v in self.manifest.items() if k != "files"}  # file checksums hold no tensors
        self.extra = empty_tensors(described)
        states["extra"] = TensorState(dict(self.extra))
        rng = self._rng_plan()
        if rng is not None:
            refuse_pickles(rng[0], "RNG state", self.allow_pickle)
            states["rng"] = TensorState(dict(rng[1]))
            self.rng = rng
        return states

    def _plan_module_load_fn(self) -> ModelState:
        """Read the whole saved ``state_dict``; hand it to ``module_load_fn(state_dict, module)`` with the
        parameters full and writable, then take the masters from the parameters as it left them."""
        fn, module, shards = self.options.module_load_fn, self.engine.module, self.shards
        model, state_dict = ModelState.whole(self.manifest)

        def call() -> None:
            live = dict(module.named_parameters())
            with self.engine.writable_full_params(), torch.no_grad():
                fn(state_dict, module)
                for shard in shards:
                    shard.master.reshape(-1).copy_(live[shard.name].detach().reshape(-1)[shard.start : shard.end])

        self.apply_entries = call
        return model

    def _read(self, states: dict[str, TensorState]) -> None:
        reader = SafeReader(self.path, self.manifest)
        # each rank reads on its own (`no_dist`): no collective for a rank dying in it to hang; the step is watched
        with dcp_errors(self.path), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(states, storage_reader=reader, planner=LoadPlanner(), no_dist=True)
        self._decode()

    def _check_keys(self, names: ModelNames, with_master: dict[str, list[int]]) -> None:
        missing, unexpected, mismatched = Sources(self.manifest).report(names, with_master)
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

    def _rng_plan(self) -> Optional[tuple[Any, dict[str, torch.Tensor]]]:
        if self.options.module_only or not self.engine.settings.save_rng_state or not self.manifest.get("rng"):
            return None
        if self.manifest["world_size"] != self.engine.comm.world_size:
            return None  # a rank's RNG stream has no counterpart at another world size
        encoded = read_rank_file(self.path, self.rank, self.manifest["world_size"],
                                 expected_digests(self.manifest, self.path / MANIFEST)).get("rng")
        if encoded is None:
            return None
        return encoded, empty_tensors(encoded)

    def _decode(self) -> None:
        """Decode every plain-data part and check it against what it will replace; apply nothing."""
        decoder = Decoder(self.extra, self.allow_pickle)
        manifest, decoded, extras = self.manifest, self.decoded, self.engine.extras()
        decoded.client_state = decoder.decode(manifest["client_state"], "client_state")
        optimizer = self.engine.optimizer
        if self.options.optimizer and optimizer is not None and manifest.get("optimizer"):
            groups = decoder.decode(manifest["optimizer"]["param_groups"], "optimizer param_groups")
            current = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            groups = self._without_scheduler_keys(groups, current, "scheduler" in extras)
            decoded.param_groups = conform(groups, current, "optimizer.param_groups")
        if self.options.scheduler and manifest.get("scheduler") is not None:
            if "scheduler" not in extras:
                warnings.warn(f"checkpoint {self.path} has lr scheduler state but this engine has no scheduler",
                              stacklevel=6)
            else:
                state = decoder.decode(manifest["scheduler"], "lr_scheduler state")
                decoded.extras["scheduler"] = conform(state, extras["scheduler"].state_dict(), "scheduler")
        if not self.options.module_only:
            self._decode_precision(decoder.decode(manifest["precision"], "precision state"), extras)
            template = extras["counters"].state_dict()
            counters = conform(manifest["counters"], template, "counters")
            if set(counters) != set(template) or any(v < 0 for v in counters.values()):  # exactly the engine's keys
                raise CheckpointError(
                    f"`counters` in the checkpoint manifest must hold {sorted(template)} as non-negative integers, "
                    f"got {counters!r}; the manifest was damaged or crafted: refusing it (nothing was changed)"
                )
            decoded.extras["counters"] = counters
        if self.rng is not None:
            # each state shaped like this process's; parts it has no generator for are dropped, as restore_rng would
            where, template = f"{self.path / rank_file(self.rank)}: rng", capture_rng()
            rng = Decoder(self.rng[1], self.allow_pickle).decode(self.rng[0], "RNG state")
            if not isinstance(rng, dict) or not {"python", "torch"} <= set(rng):
                raise CheckpointError(f"`{where}` must hold at least the `python` and `torch` states; refusing it")
            decoded.rng = conform({k: v for k, v in rng.items() if k in template}, template, where)

    def _without_scheduler_keys(self, groups: Any, current: list[dict[str, Any]], has_scheduler: bool) -> Any:
        """The saved param groups, less the keys an lr scheduler put there (``initial_lr``) when this engine has
        none: a config that differs, not a damaged checkpoint, and said so."""
        if not isinstance(groups, list) or self.manifest.get("scheduler") is None:
            return groups
        extra = sorted({k for g in groups if isinstance(g, dict) for k in g if k in SCHEDULER_KEYS}
                       - {k for g in current for k in g})
        if not extra:
            return groups
        if self.options.scheduler and not has_scheduler:
            raise CheckpointError(
                f"rank {self.rank}: {self.path} was saved by an engine with an lr scheduler (its optimizer's param "
                f"groups hold {extra}, which the scheduler adds), and this engine has none: the configs differ. "
                "Build the engine with the same `scheduler` section (or `lr_scheduler=`) as the run that saved it, "
                "or pass `load_lr_scheduler_states=False` to load everything but the schedule"
            )
        return [{k: v for k, v in g.items() if k not in extra} if isinstance(g, dict) else g for g in groups]

    def _decode_precision(self, state: Any, extras: dict[str, Any]) -> None:
        current = extras["precision"].state_dict()
        state = conform(state, current, "precision")
        if state.get("dtype") == current["dtype"]:
            self.decoded.extras["precision"] = state
        elif state.get("dtype") == "float16" or current["dtype"] == "float16":
            warnings.warn(
                f"checkpoint {self.path} was trained in {state.get('dtype')}, this engine runs in "
                f"{dtype_name(self.engine.dtype)}: the loss scaler starts fresh",
                stacklevel=6,
            )
