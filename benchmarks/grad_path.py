"""``python -m benchmarks.grad_path``: the files a gradient's path passes through, counted.

The workload is a typical one, not the case that avoids the hard path: four ``nn.Linear`` modules
(eight parameters, 1,076 elements), bf16, AdamW, gradient clipping at 1.0; stage 3 with
``stage3_param_persistence_threshold: 0``, so that every module's unit is gathered before its forward
and its backward and freed after (the module hooks' whole gather/free path); stages 0-2 with four
buckets.  One warm-up step, then one traced ``engine.backward(loss); engine.step()``, in one process
or on rank 0 of ``--world-size`` gloo ranks (shared memory carrying the collectives, as it does by
default on one host).

Every Python call into a file under ``src/shardwise`` on the thread that runs backward and step (and
on any thread started during the traced step) is followed with ``sys.settrace``; the file the
running shardwise frame belongs to is noted at each call.  Frames outside shardwise (torch's,
autograd's, the standard library's, and code Python generates for a record type: a ``NamedTuple`` or
dataclass ``__init__``) are not counted: control inside them stays with the shardwise file that
called them, so an autograd hook is a call from the file whose frame started autograd.  The threads
beneath a collective (gloo's and NCCL's in C++, shared memory's worker in Python) are not traced: they
were started before the step, and they are the transport, as c10d is for torch's own peers.
Reported, over **every file** (nothing is left out of a total):

* ``files``: distinct shardwise files the path passes through;
* ``switches``: calls from one shardwise file into another (a return to the caller is not counted:
  control goes back where it came from);
* ``returns``: switches into a file control had already been in (a file visited in pieces);
* beside the total, never instead of it: how many of those files and switches are bookkeeping
  (:data:`BOOKKEEPING`: what records or checks the step rather than holding or moving the gradient)
  and transport (:data:`TRANSPORT`: what ``Comm`` calls beneath a collective).

*One gradient* and *raw*.  Autograd calls each parameter's gradient hook, and at stage 3 each
module's pre- and post-backward hooks: a *hook episode* is everything from a call that autograd makes
into shardwise (inside a backward, from a frame outside shardwise) to the next.  The raw count keeps
every episode.  The path of one gradient takes its own module's hooks once and its own parameter's
hook once, including the launch of its bucket (unit), which happens in the hook of the bucket's last
gradient to arrive: the count keeps one episode of each kind, dropping every episode whose calls are
the same as the start of a kept one (the same hook for another parameter or module).  Everything
outside the hooks is counted as it runs (a call per bucket or unit in a loop counts each time).

Example::

    python -m benchmarks.grad_path --stage 3 --world-size 2

docs/life-of-a-gradient.md records the counts before and after a change; tests/test_grad_path.py holds
stages 2 and 3 to the target, in one process and on two ranks.
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


#: files that record or check the step rather than hold or move the gradient (the fault layer, the engine's
#: argument checks, the log), reported beside the total
BOOKKEEPING = frozenset({"faults/ledger.py", "faults/announce.py", "faults/heartbeat.py", "faults/diagnose.py",
                         "engine/checks.py", "log.py"})

#: what ``Comm`` may call beneath a collective (shared memory, the control group's set-up and reports, the sliced
#: wait that reads the peers' published errors), reported beside the total
TRANSPORT = frozenset({"comm/shm.py", "faults/control.py", "faults/published.py", "faults/liveness.py"})

#: the target of issue 36 for stages 2 and 3, two ranks (and one process): at most this many files and switches,
#: every file counted
TARGET = (7, 20)


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

    def counts(self) -> dict[str, Any]:
        """Files; switches (calls from one file into another; a return to the caller is not one: control
        goes back where it came from); returns (switches into a file control had already been in); beside them,
        the files and switches of :data:`BOOKKEEPING` and :data:`TRANSPORT` among those."""
        seen: set[str] = set()
        switches = returns = 0
        path: list[str] = []
        into: dict[str, int] = {}
        for caller, callee in self.calls:
            if caller:
                seen.add(caller)
                switches += 1
                returns += callee in seen
                into[callee] = into.get(callee, 0) + 1
            seen.add(callee)
            path.append(f"{caller} > {callee}" if caller else callee)
        beside = {name: {"files": sorted(seen & kind), "switches": sum(into.get(f, 0) for f in kind)}
                  for name, kind in (("bookkeeping", BOOKKEEPING), ("transport", TRANSPORT))}
        return {"files": len(seen), "switches": switches, "returns": returns, "beside": beside, "path": path,
                "file_list": sorted(seen)}


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


def build_model() -> nn.Module:
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
    engine = shardwise.initialize(build_model(), config=workload(stage))
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
    """:func:`trace_path` on ``world_size`` gloo ranks (rank 0's path): with more than one rank the agreements
    (the backward's announcement, the step check), the norm's all-reduce and the regather are on the path too."""
    if world_size == 1:
        return trace_path(stage)
    from shardwise.testing import run_distributed  # the harness only when ranks are launched

    path = run_distributed(_rank_zero_path, world_size, args=(stage,), timeout=300)[0]
    assert path is not None
    return path


def _line(what: str, count: dict[str, Any]) -> str:
    beside = "; ".join(f"{name} among them: {len(part['files'])} files ({', '.join(part['files']) or 'none'}), "
                       f"{part['switches']} switches into them" for name, part in count["beside"].items())
    return (f"{what}: {count['files']} files, {count['switches']} switches, {count['returns']} into a file already "
            f"left ({beside})")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3))
    parser.add_argument("--world-size", type=int, default=1, help="gloo ranks to trace on (rank 0's path)")
    parser.add_argument("--json", action="store_true", help="print the counts and the path as JSON")
    args = parser.parse_args(argv)
    raw = trace_ranks(args.stage, args.world_size)
    counts = {"one gradient, every file": raw.one_gradient().counts(), "raw (every hook), every file": raw.counts()}
    if args.json:
        print(json.dumps(counts, indent=1))
        return 0
    where = "one process" if args.world_size == 1 else f"{args.world_size} ranks"
    for what, count in counts.items():
        print(_line(f"stage {args.stage}, {where}, {what}", count))
        print("  files: " + ", ".join(count["file_list"]))
        print("  " + "; ".join(count["path"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
