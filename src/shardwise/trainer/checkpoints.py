"""The trainer's checkpoints: collective saves under ``checkpoint_dir`` (``global_step{N}``), pruning to ``keep_last``
besides the best one (named in ``best``), and resume. Every rank saves at the same step (the trainer decides saves
collectively), so the engine's collective save can never hang on a rank that skipped it.
"""

from __future__ import annotations

import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Optional

from ..checkpoint.commit import write_atomic
from ..checkpoint.files import CheckpointError

__all__ = ["Checkpoints", "ResumeError"]

_TAG = re.compile(r"^global_step(\d+)$")
# The engine warns when `load_checkpoint` finds nothing; for a trainer starting fresh that is expected.
_NOTHING_TO_LOAD = r".*holds no complete checkpoint"


class ResumeError(RuntimeError):
    """``checkpoint_dir`` holds a checkpoint this run cannot continue from."""


class Checkpoints:
    """Saves and resumes one engine's run in ``directory``."""

    def __init__(self, engine: Any, directory: Optional[str], keep_last: Optional[int]) -> None:
        self.engine = engine
        self.directory = Path(directory) if directory is not None else None
        self.keep_last = keep_last
        #: the step of the newest checkpoint this run wrote or resumed from
        self.last_step: Optional[int] = None
        self.last_path: Optional[str] = None
        #: the step of the best checkpoint (kept whatever ``keep_last`` says), when a metric is watched
        self.best_step: Optional[int] = None

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def save(self, client_state: dict[str, Any]) -> str:
        """Write ``global_step{N}`` (collective), then prune; returns its path."""
        assert self.directory is not None, "save() without a checkpoint_dir"  # the trainer checks first
        step = self.engine.global_steps
        path = self.engine.save_checkpoint(str(self.directory), tag=f"global_step{step}", client_state=client_state)
        self.last_step, self.last_path = step, str(path)
        if self.best_step == step:
            self._write_best()
        if self.engine.comm.rank == 0:
            self._prune()
        return str(path)

    def _prune(self) -> None:
        if self.keep_last is None or self.directory is None:
            return
        found = sorted((int(m.group(1)), child) for child in self.directory.iterdir()
                       if child.is_dir() and (m := _TAG.match(child.name)))
        for step, old in found[: max(len(found) - self.keep_last, 0)]:
            if step != self.best_step:
                shutil.rmtree(old, ignore_errors=True)

    def path_of(self, step: Optional[int]) -> Optional[str]:
        """The directory of the checkpoint at ``step`` (None without a directory or a step)."""
        return str(self.directory / f"global_step{step}") if self.directory is not None and step is not None else None

    def mark_best(self, step: int) -> None:
        """Keep ``global_step{step}`` from pruning; ``best`` names it once it is saved."""
        self.best_step = step
        if self.last_step == step:
            self._write_best()

    def _write_best(self) -> None:
        """Rank 0 names the best checkpoint in ``best`` (atomically; only once that checkpoint is complete)."""
        if self.directory is None or self.engine.comm.rank != 0:
            return
        write_atomic(self.directory / "best", f"global_step{self.best_step}\n".encode())

    def resume(self) -> Optional[dict[str, Any]]:
        """Load ``latest`` (collective); its client state, or None when the directory holds no checkpoint."""
        if self.directory is None:
            return None
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_NOTHING_TO_LOAD)
                path, client_state = self.engine.load_checkpoint(str(self.directory))
        except CheckpointError as error:
            raise ResumeError(
                f"cannot resume from `checkpoint_dir` {self.directory}: {error}. That directory holds a checkpoint "
                "of another model or setup: give this run a new `checkpoint_dir`, or pass `resume=False` "
                "(and a new directory) to start fresh") from error
        if path is None:
            return None
        self.last_step, self.last_path = self.engine.global_steps, str(path)
        return client_state if client_state is not None else {}
