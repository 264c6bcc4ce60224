"""``python -m benchmarks.grad_path``: the files a gradient's path passes through, counted.

One process, a tiny two-layer model, one warm-up step, then one traced
``engine.backward(loss); engine.step()`` at the chosen ZeRO stage.  Every
Python call and return inside ``src/shardwise`` is followed with
``sys.settrace``; the file the running shardwise frame belongs to is noted at
each event (frames outside shardwise, torch's own, are not counted: control
inside them stays with the shardwise file that called them).  Reported:

* ``files``: distinct shardwise files the path passes through;
* ``switches``: calls from one shardwise file into another (a return to the
  caller is not counted: control goes back where it came from);
* ``returns``: switches into a file control had already been in (a file
  visited in pieces, the knot this count exists to show).

Each count is given twice: over every file, and over the files that hold or
move the gradient (:data:`BOOKKEEPING` left out).

Example::

    python -m benchmarks.grad_path --stage 2

docs/life-of-a-gradient.md records the counts before and after a change.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Optional

import torch
from torch import nn

__all__ = ["PathCount", "main", "trace_path"]

import shardwise

#: only frames of files under this folder (the shardwise imported: PYTHONPATH picks which) are counted
_ROOT = str(Path(shardwise.__file__).resolve().parent) + "/"


#: files that never hold or move a gradient (the step check's ledger, the accumulation-count check, the loss
#: scaler, the parameter gathers in flight): left out of the "gradient only" count, as the issue's own count did
BOOKKEEPING = frozenset({"faults/ledger.py", "checks.py", "precision.py", "zero/pending.py", "log.py"})


class PathCount:
    """The calls between shardwise files along the path, with their counts."""

    def __init__(self) -> None:
        #: (caller's file, callee's file) for every call that crosses from one shardwise file into another
        self.calls: list[tuple[str, str]] = []

    def note(self, caller: Optional[str], callee: str) -> None:
        """A call from ``caller`` (None: from outside shardwise, e.g. an autograd hook) into ``callee``."""
        callee = callee[len(_ROOT) :]
        caller = caller[len(_ROOT) :] if caller is not None else None
        if caller != callee:
            self.calls.append((caller or "", callee))

    def counts(self, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
        """Files; switches (calls from one file into another; a return to the caller is not one: control
        goes back where it came from); returns (switches into a file control had already been in)."""
        seen: set[str] = set()
        switches = returns = 0
        path: list[str] = []
        for caller, callee in self.calls:
            if callee in skip or caller in skip:
                continue
            if caller:
                seen.add(caller)
                switches += 1
                returns += callee in seen
            seen.add(callee)
            path.append(f"{caller} > {callee}" if caller else callee)
        return {"files": len(seen), "switches": switches, "returns": returns, "path": path}


def _shardwise_file(frame: Optional[FrameType]) -> Optional[str]:
    """The file of the nearest shardwise frame at or above ``frame`` (None: none is)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith(_ROOT):
            return frame.f_code.co_filename
        frame = frame.f_back
    return None


def _tracer(count: PathCount) -> Callable[..., Any]:
    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code.co_filename.startswith(_ROOT):
            count.note(_shardwise_file(frame.f_back), frame.f_code.co_filename)
        return None  # calls are all that is counted: no per-line tracing

    return trace


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def trace_path(stage: int) -> PathCount:
    """One traced backward and step at ``stage`` (after one untraced warm-up step), in this process."""
    model = _model()
    config = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": 2}
    engine = shardwise.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    inputs = torch.randn(2, 8)
    for traced in (False, True):
        loss = engine(inputs).pow(2).sum()
        count = PathCount()
        if traced:
            threading.settrace(_tracer(count))
            sys.settrace(_tracer(count))
        try:
            engine.backward(loss)
            engine.step()
        finally:
            sys.settrace(None)
            threading.settrace(None)  # type: ignore[arg-type]
    engine.destroy()
    return count


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    parser.add_argument("--json", action="store_true", help="print the counts and the path as JSON")
    args = parser.parse_args(argv)
    path = trace_path(args.stage)
    counts = {"every file": path.counts(), "gradient only": path.counts(BOOKKEEPING)}
    if args.json:
        print(json.dumps(counts, indent=1))
        return 0
    for what, count in counts.items():
        print(f"stage {args.stage}, {what}: {count['files']} files, {count['switches']} switches, "
              f"{count['returns']} into a file already left")
        print("  " + "; ".join(count["path"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
