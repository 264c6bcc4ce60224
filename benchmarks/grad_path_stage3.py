"""``python -m benchmarks.grad_path_stage3``: the files a stage-3 gradient's path passes through, counted.

One process (a world of 1), a tiny two-layer model at ZeRO stage 3 with no
persistent unit, one untraced warm-up step, then one traced
``engine.backward(loss); engine.step()``.  Every Python call and return is
followed with ``sys.settrace``; at each event the file of the nearest frame
inside ``src/shardwise`` is noted (torch's own frames are not counted: control
inside them stays with the shardwise file that called them, so autograd firing
a stage-3 hook counts as a switch from engine.py to the hook's file).  Reported:

* ``files``: distinct shardwise files the path passes through;
* ``switches``: how often control moves from one shardwise file to another;
* ``returns``: switches into a file control had already left (a file visited in
  pieces);
* ``path``: the files in the order control visits them, and with ``--calls``
  the ``file:function`` entered at each switch.

With ``--gradient`` only the frames that move the gradient count: those inside
the stage-3 gradient hook, ``finish_backward`` and the optimizer step, and
``Engine.backward``/``Engine.step`` themselves; the engine's bookkeeping (fault
ledger, loss checks) and the regathering of parameters for backward do not.

docs/life-of-a-gradient-stage3.md records the counts before and after the
stage-3 refactor.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Optional

import torch
from torch import nn

__all__ = ["PathCount", "main", "trace_stage3"]

def _package_root() -> str:
    spec = importlib.util.find_spec("shardwise")  # the package on the path: the one traced
    if spec is None or spec.origin is None:
        raise SystemExit("shardwise is not importable; run with `PYTHONPATH=src`")
    return str(Path(spec.origin).resolve().parent) + "/"


#: only frames of files under this folder are counted
_ROOT = _package_root()
#: (file, function) of the frames under which the gradient moves (``--gradient``)
_CARRIERS = {("zero/stage3.py", "_on_grad"), ("zero/stage3.py", "finish_backward"), ("zero/optimizer.py", "step")}
#: the entry points themselves (control returns to them between hooks)
_ROOTS = {("engine.py", "backward"), ("engine.py", "step"), ("engine.py", "_step")}


class PathCount:
    """The shardwise files control passed through, in order, with the function entered at each switch."""

    def __init__(self) -> None:
        self.sequence: list[str] = []
        self.entered: list[str] = []

    def note(self, frame: FrameType) -> None:
        """Control is now in ``frame`` (a frame of a file under src/shardwise)."""
        name = frame.f_code.co_filename[len(_ROOT) :]
        if not self.sequence or self.sequence[-1] != name:
            self.sequence.append(name)
            self.entered.append(f"{name}:{frame.f_code.co_name}")

    def counts(self) -> dict[str, Any]:
        seen: set[str] = set()
        returns = 0
        for name in self.sequence:
            returns += name in seen
            seen.add(name)
        return {"files": len(seen), "switches": max(len(self.sequence) - 1, 0), "returns": returns,
                "path": self.sequence, "calls": self.entered}


def _shardwise_frame(frame: Optional[FrameType]) -> Optional[FrameType]:
    """The nearest frame of a shardwise file at or above ``frame`` (None: none is)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith(_ROOT):
            return frame
        frame = frame.f_back
    return None


def _where(frame: FrameType) -> tuple[str, str]:
    return frame.f_code.co_filename[len(_ROOT) :], frame.f_code.co_name


def _moves_gradient(here: FrameType) -> bool:
    """Whether ``here`` is an entry point, or runs under a frame that carries the gradient."""
    if _where(here) in _ROOTS:
        return True
    frame: Optional[FrameType] = here
    while frame is not None:
        if frame.f_code.co_filename.startswith(_ROOT) and _where(frame) in _CARRIERS:
            return True
        frame = frame.f_back
    return False


def _tracer(count: PathCount, gradient_only: bool) -> Callable[..., Any]:
    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call":
            here = _shardwise_frame(frame)
        elif event == "return":
            here = _shardwise_frame(frame.f_back)
        else:
            return trace
        if here is not None and (not gradient_only or _moves_gradient(here)):
            count.note(here)
        return trace

    return trace


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def trace_stage3(gradient_only: bool = False) -> PathCount:
    """One traced backward and step at stage 3 (after one untraced warm-up step), in this process."""
    import shardwise

    model = _model()
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "train_micro_batch_size_per_gpu": 2}
    engine = shardwise.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    inputs = torch.randn(2, 8)
    count = PathCount()
    for traced in (False, True):
        loss = engine(inputs).pow(2).sum()
        if traced:
            threading.settrace(_tracer(count, gradient_only))
            sys.settrace(_tracer(count, gradient_only))
        try:
            engine.backward(loss)
            engine.step()
        finally:
            sys.settrace(None)
            threading.settrace(None)  # type: ignore[arg-type]
    engine.destroy()
    return count


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the counts and the path as JSON")
    parser.add_argument("--calls", action="store_true", help="print the function entered at each switch")
    parser.add_argument("--gradient", action="store_true", help="count only the frames that move the gradient")
    args = parser.parse_args(argv)
    counts = trace_stage3(args.gradient).counts()
    if args.json:
        print(json.dumps(counts, indent=1))
        return 0
    print(f"stage 3: {counts['files']} files, {counts['switches']} switches, "
          f"{counts['returns']} returns into a file already left")
    print(" -> ".join(counts["calls"] if args.calls else counts["path"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
