"""``python -m benchmarks.grad_path``: the files a gradient's path passes through, counted.

One process, a tiny two-layer model (four parameters), one warm-up step, then
one traced ``engine.backward(loss); engine.step()`` at the chosen ZeRO stage.
Every Python call and return inside ``src/shardwise`` is followed with
``sys.settrace``; the file the running shardwise frame belongs to is noted at
each event (frames outside shardwise, torch's own, are not counted: control
inside them stays with the shardwise file that called them).  Reported:

* ``files``: distinct shardwise files the path passes through;
* ``switches``: calls from one shardwise file into another (a return to the
  caller is not counted: control goes back where it came from);
* ``returns``: switches into a file control had already been in (a file
  visited in pieces, the knot this count exists to show).

*One gradient* and *raw*.  Autograd calls each parameter's gradient hook: a
*hook episode* is everything from a call that autograd makes into shardwise
(inside a backward, from a frame outside shardwise) to the next.  The raw count
keeps every episode: the four parameters' hooks.  The path of one gradient
takes its own parameter's hook once, and the launch of its bucket (unit),
which happens in the hook of the bucket's last gradient to arrive: it keeps
the episode that launches and drops every episode whose calls are the same as
the start of a kept one (the same hook taking another parameter's gradient).
The gradient followed is thus the last of its bucket (unit) to arrive.

Each count is given over every file, and over the files that hold or move
the gradient (:data:`BOOKKEEPING` left out).

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
#: scaler, the parameter gathers in flight, the announcement of the backward to the other ranks): left out of
#: the "gradient only" count, as the issue's own count did
BOOKKEEPING = frozenset({"faults/ledger.py", "checks.py", "precision.py", "zero/pending.py", "log.py",
                         "faults/announce.py"})

#: what ``Comm`` calls beneath a collective when ranks are launched (shared memory, the exit watch, the fault
#: control, the sliced wait that reads the peers' published errors): a one-process trace never reaches them;
#: the several-rank report gives counts with and without
TRANSPORT = frozenset({"shm.py", "exit.py", "faults/control.py", "faults/published.py"})


class PathCount:
    """The calls between shardwise files along the path, with their counts."""

    def __init__(self) -> None:
        #: (caller's file, callee's file) for every call that crosses from one shardwise file into another
        self.calls: list[tuple[str, str]] = []
        #: per call, the hook episode it belongs to (None: outside autograd's calls into shardwise)
        self.episodes: list[Optional[int]] = []
        self._episode = -1

    def note(self, caller: Optional[str], callee: str, from_autograd: bool = False, in_autograd: bool = False) -> None:
        """A call from ``caller`` (None: from outside shardwise, e.g. an autograd hook) into ``callee``;
        ``from_autograd``: autograd itself made it (a hook episode starts); ``in_autograd``: a backward runs."""
        if from_autograd:
            self._episode += 1
        callee = callee[len(_ROOT) :]
        caller = caller[len(_ROOT) :] if caller is not None else None
        if caller != callee:
            self.calls.append((caller or "", callee))
            self.episodes.append(self._episode if in_autograd and self._episode >= 0 else None)

    def one_gradient(self) -> "PathCount":
        """The path of one gradient: hook episodes that repeat the start of another kept one are dropped."""
        runs: dict[int, list[tuple[str, str]]] = {}
        for call, episode in zip(self.calls, self.episodes):
            if episode is not None:
                runs.setdefault(episode, []).append(call)
        dropped = {e for e, run in runs.items() if _repeats(e, run, runs)}
        path = PathCount()
        for call, episode in zip(self.calls, self.episodes):
            if episode not in dropped:
                path.calls.append(call)
                path.episodes.append(episode)
        return path

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


def _repeats(episode: int, run: list[tuple[str, str]], runs: dict[int, list[tuple[str, str]]]) -> bool:
    """Whether ``run`` is the start of another episode's calls (a longer one, or an equal earlier one)."""
    for other, calls in runs.items():
        if other != episode and calls[: len(run)] == run and (len(calls) > len(run) or other < episode):
            return True
    return False


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
            in_autograd = torch._C._current_graph_task_id() != -1
            direct = frame.f_back is not None and frame.f_back.f_code.co_filename.startswith(_ROOT)
            count.note(_shardwise_file(frame.f_back), frame.f_code.co_filename, in_autograd and not direct, in_autograd)
        return None  # calls are all that is counted: no per-line tracing

    return trace


#: the traced model: four Linear modules (eight parameters, 1,076 elements), so that stage 3 at threshold 0 keeps
#: four units of its own, each gathered before its module's forward and backward and freed after
SIZES = (8, 24, 16, 16, 4)


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for fan_in, fan_out in zip(SIZES, SIZES[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def workload(stage: int) -> dict[str, Any]:
    """The traced configuration: bf16, AdamW, clipping; stage 3 with no persistent unit (every module's
    parameters gathered and freed around its forward and backward), stages 0-2 with several buckets."""
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    else:
        zero["reduce_bucket_size"] = 300  # four buckets: one per Linear module
    return {
        "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}, "zero_optimization": zero,
    }


def trace_path(stage: int) -> PathCount:
    """One traced backward and step at ``stage`` (after one untraced warm-up step), in this process."""
    engine = shardwise.initialize(_model(), config=workload(stage))
    inputs = torch.randn(2, SIZES[0])
    for traced in (False, True):
        loss = engine(inputs).float().pow(2).sum()
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


def _rank_zero_path(stage: int) -> Optional[PathCount]:
    """In a rank of :func:`trace_ranks`: the traced path on rank 0 (the others only take part)."""
    count = trace_path(stage)
    # the harness called the traced function: autograd-style, from outside the path
    count.calls = [("" if caller == "testing.py" else caller, callee) for caller, callee in count.calls]
    return count if torch.distributed.get_rank() == 0 else None


def trace_ranks(stage: int, world_size: int) -> PathCount:
    """:func:`trace_path` on ``world_size`` gloo ranks (rank 0's path): with more than one rank the flat
    stages shard, so the norm's all-reduce and the regather of updated slices are on the path too."""
    if world_size == 1:
        return trace_path(stage)
    from shardwise.testing import run_distributed  # the harness only when ranks are launched

    path = run_distributed(_rank_zero_path, world_size, args=(stage,), timeout=300)[0]
    assert path is not None
    return path


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    parser.add_argument("--world-size", type=int, default=1, help="gloo ranks to trace on (rank 0's path)")
    parser.add_argument("--json", action="store_true", help="print the counts and the path as JSON")
    args = parser.parse_args(argv)
    raw = trace_ranks(args.stage, args.world_size)
    one = raw.one_gradient()
    counts = {
        "one gradient, gradient only": one.counts(BOOKKEEPING), "one gradient, every file": one.counts(),
        "raw (every hook), gradient only": raw.counts(BOOKKEEPING), "raw (every hook), every file": raw.counts(),
    }
    if args.world_size > 1:
        counts["one gradient, gradient only, above the transport"] = one.counts(BOOKKEEPING | TRANSPORT)
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
