"""Multi-rank test harness: run a function on N fresh processes with torch.distributed ready.

Each launch starts ``world_size`` processes, rendezvouses them through a file in a fresh temporary directory (no port
clashes between concurrent test runs), initializes a process group (gloo by default) and calls the function on every
rank: `run_distributed` (a function; its results come back), `distributed_test` (a pytest test's body on every rank;
README.md, "Testing your own code on several ranks") and `run_subtests` (several cases in one launch, inside a rank).

Failures never hang: a rank that raises, dies or exceeds ``timeout`` makes the launch raise `DistributedTestError`
naming the rank, with its traceback (or exit code, or the Python stack it was stuck in), and every other rank is killed.

Ranks are forked from a ``multiprocessing`` forkserver that has already imported torch (with ``torch._dynamo``, which
torch otherwise imports lazily on the first optimizer step) and shardwise, but never ran a torch op: a launch then costs
a fork instead of a fresh interpreter importing torch, and no rank inherits a live OpenMP thread pool (forking a process
that ran parallel torch ops can deadlock the child). Set the environment variable ``SHARDWISE_TEST_START_METHOD=spawn``
(or pass ``start_method="spawn"``) to use fresh interpreters instead.

What a rank needs must be picklable: the function (defined at module level, so the rank can import it by name), its
arguments and its return value. Like any ``multiprocessing`` program, a script that calls `run_distributed` must guard
its entry point with ``if __name__ == "__main__":``. Only torch and the standard library are used here.
"""

from __future__ import annotations

import faulthandler
import functools
import importlib
import importlib.util
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple, NoReturn, TypeVar, cast

__all__ = ["DistributedTestError", "distributed_test", "run_distributed", "run_subtests"]

_F = TypeVar("_F", bound=Callable[..., Any])

# Modules the forkserver imports once so that every rank forked from it starts warm. Only those already imported by the
# caller are preloaded: a module that fails to import with anything but ImportError would kill the forkserver itself.
_PRELOAD_CANDIDATES = ("torch", "torch.distributed", "numpy", "pytest", "shardwise")
# Preloaded whenever torch is: torch imports it lazily on the first optimizer step or DDP
# construction, which costs every rank of nearly every training test 3+ s on 2 cores.
_TORCH_LAZY_PRELOADS = ("torch._dynamo",)
_START_METHOD_ENV = "SHARDWISE_TEST_START_METHOD"
_BODY_ATTR = "_shardwise_rank_body"
# The process group's own timeout is longer than the launch timeout so that a stuck
# collective is reported by the launcher (with the rank's stack), not by gloo.
_PG_TIMEOUT_MARGIN_S = 60.0
# A rank outliving its launcher (launcher killed) ends itself this long after `timeout`.
_ORPHAN_GRACE_S = 30.0
_STACK_DUMP_WAIT_S = 1.0
_FAILURE_GRACE_S = 0.25
_TAIL_CHARS = 3000
_LAUNCH_LOCK = threading.Lock()
# Files a rank must keep open for its whole life (the SIGUSR1 stack-dump target).
_KEEP_OPEN: list[Any] = []


class DistributedTestError(RuntimeError):
    """A multi-rank launch failed: a rank raised, died, or did not finish in time."""


# --------------------------------------------------------------------------- files


class _RankFiles(NamedTuple):
    """Where one rank leaves its result, error, output and stack dump (in the launch dir)."""

    result: Path
    error: Path
    stdout: Path
    stderr: Path
    stack: Path


def _rank_files(root: Path, rank: int) -> _RankFiles:
    return _RankFiles(*(root / f"rank{rank}.{suffix}" for suffix in ("result", "error", "out", "err", "stack")))


def _write_atomic(path: Path, data: bytes) -> None:
    """Write `data` so the launcher sees either nothing or the whole file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _read_text(path: Path) -> str:
    try:  # "" when the rank never wrote it
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _tail(text: str, limit: int = _TAIL_CHARS) -> str:
    return text if len(text) <= limit else "...\n" + text[-limit:]


# --------------------------------------------------------------------------- the rank side


@dataclass(frozen=True)
class _RankSpec:
    """Everything a rank needs to join the world; sent to the rank with its function."""

    rank: int
    world_size: int
    launch_dir: str
    init_file: str
    master_port: int
    backend: str
    timeout: float
    threads_per_rank: int | None
    environ: dict[str, str]

    @property
    def files(self) -> _RankFiles:
        return _rank_files(Path(self.launch_dir), self.rank)


def _rank_entry(spec: _RankSpec, call: bytes) -> None:
    """Process target: set the rank up, run the call, leave its result or traceback in a file.

    `call` is the pickled ``(fn, args, kwargs)``: unpickling it here, after output capture,
    turns a test module that fails to import into a reported traceback.
    """
    _capture_output(spec.files)
    _install_fault_handlers(spec)
    _apply_environment(spec)
    try:
        fn, args, kwargs = pickle.loads(call)
        _init_process_group(spec)
        result = fn(*args, **kwargs)
        if dist := _dist():
            dist.destroy_process_group()
        payload = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException:  # noqa: BLE001 - SystemExit/KeyboardInterrupt are failures too
        _report_error_and_exit(spec.files)
    _write_atomic(spec.files.result, payload)


def _capture_output(files: _RankFiles) -> None:
    """Send fds 1 and 2 to per-rank files so C++ output (gloo, torch) is kept as well."""
    for fd, path in ((1, files.stdout), (2, files.stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    # Line buffering: output printed just before a SIGKILL must not sit in a buffer.
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)


def _install_fault_handlers(spec: _RankSpec) -> None:
    """Make a crash, a stuck rank and an orphaned rank each leave a Python stack behind."""
    stderr = sys.stderr
    faulthandler.enable(file=stderr, all_threads=True)
    if hasattr(faulthandler, "register"):
        # The launcher sends SIGUSR1 to a rank that missed the timeout; the C-level handler
        # runs even while the rank is blocked inside a gloo collective.
        stack_file = open(spec.files.stack, "w")  # noqa: SIM115 - lives as long as the rank
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
        _KEEP_OPEN.append(stack_file)
    # If the launcher itself dies, nobody kills this rank: end it after a generous delay.
    try:
        faulthandler.dump_traceback_later(spec.timeout + _ORPHAN_GRACE_S, exit=True, file=stderr)
    except OverflowError:
        pass  # a timeout too large for the timer is as good as none


def _apply_environment(spec: _RankSpec) -> None:
    """Give the rank the launcher's environment plus the variables torchrun would set."""
    # A forkserver child inherits the server's environment from when it started; the
    # launcher's current one is what a test (e.g. monkeypatch.setenv) expects to see.
    os.environ.clear()
    os.environ.update(spec.environ)
    os.environ.update({
        "RANK": str(spec.rank),
        "WORLD_SIZE": str(spec.world_size),
        "LOCAL_RANK": str(spec.rank),
        "LOCAL_WORLD_SIZE": str(spec.world_size),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(spec.master_port),
    })
    if spec.threads_per_rank is not None:
        os.environ["OMP_NUM_THREADS"] = str(spec.threads_per_rank)


def _init_process_group(spec: _RankSpec) -> None:
    """Join the world through the launch's rendezvous file."""
    import torch  # here: the harness imports torch only inside a rank, not at its own import
    import torch.distributed as dist

    if spec.threads_per_rank is not None:
        torch.set_num_threads(spec.threads_per_rank)
    if "nccl" in spec.backend and torch.cuda.is_available():
        torch.cuda.set_device(spec.rank % torch.cuda.device_count())
    dist.init_process_group(
        backend=spec.backend,
        init_method=f"file://{spec.init_file}",
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.timeout + _PG_TIMEOUT_MARGIN_S),
    )
    # gloo's init can return on one rank while a peer is still connecting; a rank that then
    # returns and exits at once breaks that peer's init ("Connection closed by peer").
    dist.barrier()


def _dist() -> Any:
    """`torch.distributed` while a default group is initialized (the function may have destroyed it), else None."""
    import torch.distributed as dist  # here: the harness imports torch only inside a rank, not at its own import

    return dist if dist.is_available() and dist.is_initialized() else None


def _report_error_and_exit(files: _RankFiles) -> NoReturn:
    """Save the traceback first (the launcher may kill us any moment), then leave at once."""
    try:
        _write_atomic(files.error, traceback.format_exc().encode())
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # os._exit skips the process-group teardown, which could block on peers that are
        # still waiting in a collective this rank will never join.
        os._exit(1)


# --------------------------------------------------------------------------- the launcher side


def _context(requested: str | None) -> BaseContext:
    """Forkserver (started warm) where the platform has it, unless the caller or the environment asks otherwise."""
    available = multiprocessing.get_all_start_methods()
    method = requested or os.environ.get(_START_METHOD_ENV) or ("forkserver" if "forkserver" in available else "spawn")
    if method not in available:
        raise ValueError(f"start method `{method}` is not available here; expected one of {available}.")
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        _ensure_warm_forkserver(ctx)
    return ctx


def _ensure_warm_forkserver(ctx: BaseContext) -> None:
    """Start the forkserver with our preloads and with the caller's sys.path."""
    from multiprocessing import forkserver  # here: a private module of the stdlib, only for this launch mode

    preload = [name for name in _PRELOAD_CANDIDATES if name in sys.modules]
    if "torch" in preload:
        preload += _TORCH_LAZY_PRELOADS
    ctx.set_forkserver_preload(preload)  # type: ignore[attr-defined]
    # Python <3.13 ignores the sys.path it hands the server, so without this a preloaded
    # module could come from a different place than the caller's copy (e.g. an installed
    # shardwise instead of the src/ checkout). Ranks get the full sys.path again on start.
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def _pickle_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """Pickle the call once for all ranks, failing before any process starts."""
    try:
        return pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise TypeError(
            f"could not send `{getattr(fn, '__qualname__', fn)!r}` or its arguments to the "
            f"ranks: {exc}. The function must be defined at module level (not a lambda or "
            "a nested function) and its arguments (for `distributed_test`: the fixture and "
            "parametrize values) must be picklable."
        ) from exc


def _kill_all(procs: Iterable[BaseProcess]) -> None:
    """SIGKILL every rank still alive and reap it; ranks blocked in C++ ignore gentler signals."""
    procs = list(procs)
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()
    for proc in procs:
        proc.join(timeout=10.0)


@dataclass
class _Outcome:
    """How a launch ended: ranks that returned, failed on their own, or outlived the deadline."""

    finished: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)  # in the order their exits were seen
    timed_out: list[int] = field(default_factory=list)


def _watch(procs: Sequence[BaseProcess], deadline: float, launch_dir: Path,
           expect_dead: Collection[int] = ()) -> _Outcome:
    """Wait for ranks to exit, until all did, shortly after the first failure, or the deadline.

    A rank in `expect_dead` that ends without a traceback counts as finished (its result: None).
    """
    outcome = _Outcome()
    pending = dict(enumerate(procs))
    stop = deadline
    while pending and (remaining := stop - time.monotonic()) > 0:
        by_sentinel = {proc.sentinel: rank for rank, proc in pending.items()}
        for sentinel in multiprocessing.connection.wait(list(by_sentinel), timeout=remaining):
            rank = by_sentinel[cast(int, sentinel)]  # we waited on sentinels only (ints)
            proc = pending.pop(rank)
            proc.join()
            files = _rank_files(launch_dir, rank)
            succeeded = proc.exitcode == 0 and files.result.exists()
            succeeded = succeeded or (rank in expect_dead and not files.error.exists())
            (outcome.finished if succeeded else outcome.failed).append(rank)
        if outcome.failed and stop == deadline:
            # Peers of a failed rank often fail a moment later (gloo sees the closed
            # connection); let them report, so the first cause can be told from the echoes.
            stop = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
    if not outcome.failed:
        outcome.timed_out = sorted(pending)
    return outcome


def _dump_stacks(procs: Sequence[BaseProcess], ranks: Sequence[int], launch_dir: Path) -> None:
    """Ask stuck ranks for their Python stacks (SIGUSR1 -> faulthandler) and wait briefly."""
    if not hasattr(signal, "SIGUSR1"):
        return
    for rank in ranks:
        pid = procs[rank].pid
        if pid is not None and procs[rank].exitcode is None:
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    stop = time.monotonic() + _STACK_DUMP_WAIT_S
    files = [_rank_files(launch_dir, rank).stack for rank in ranks]
    while time.monotonic() < stop and not all(_read_text(f).strip() for f in files):
        time.sleep(0.02)
    time.sleep(0.05)  # a dump that has started may still be writing its other threads


def _describe_exit(exitcode: int | None) -> str:
    """Say how a rank that left no result ended."""
    if exitcode is None:
        return "was still running and was killed"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name} (exit code {exitcode})"
    return f"exited with code {exitcode} {'without returning' if exitcode == 0 else 'before returning'} a result"


def _rank_report(procs: Sequence[BaseProcess], rank: int, launch_dir: Path) -> str:
    """Describe one failed rank: its traceback, or its exit status and last stderr lines."""
    files = _rank_files(launch_dir, rank)
    error = _read_text(files.error)
    if error:
        return f"rank {rank} raised:\n{error.rstrip()}"
    report = f"rank {rank} {_describe_exit(procs[rank].exitcode)}"
    stderr = _read_text(files.stderr).strip()
    if stderr:
        report += f"; the end of its stderr:\n{_tail(stderr)}"
    return report


def _cause_first(failed: Sequence[int], launch_dir: Path) -> list[int]:
    """Order failed ranks so the likely cause comes first and its echoes after.

    A rank that died without a traceback (os._exit, a signal, a segfault) comes first: a peer's loss makes gloo raise in
    the other ranks, it does not kill them. Ranks that raised follow in the order they wrote their tracebacks. Exit
    order as seen here is only a tie-break: the forkserver may relay two nearly simultaneous exits either way.
    """
    def key(rank: int) -> tuple[int, int, int]:
        error = _rank_files(launch_dir, rank).error
        return (1, error.stat().st_mtime_ns, failed.index(rank)) if error.exists() else (0, 0, failed.index(rank))

    return sorted(failed, key=key)


def _crash_message(outcome: _Outcome, procs: Sequence[BaseProcess], launch_dir: Path) -> str:
    """Report the rank that failed first, the ranks that failed after it, and those killed."""
    first, *others = _cause_first(outcome.failed, launch_dir)
    parts = [f"rank {first} of {len(procs)} failed.", _rank_report(procs, first, launch_dir)]
    parts += [f"(then) {_rank_report(procs, rank, launch_dir)}" for rank in others]
    killed = [r for r in range(len(procs)) if r not in outcome.failed + outcome.finished]
    if killed:
        parts.append(f"ranks {killed} were killed after rank {first} failed.")
    return "\n\n".join(parts)


def _timeout_message(outcome: _Outcome, world: int, launch_dir: Path, timeout: float) -> str:
    """Report the ranks still running at the deadline, with the stacks they were stuck in."""
    parts = [
        f"ranks {outcome.timed_out} of {world} did not finish within the {timeout:g} s timeout (finished: "
        f"{outcome.finished}); every rank was killed. A rank is stuck (often in a collective that not every rank "
        "called) or the work needs a larger `timeout=`."]
    for rank in outcome.timed_out:
        stack = _read_text(_rank_files(launch_dir, rank).stack).strip()
        parts.append(f"rank {rank} Python stack at the timeout:\n{_tail(stack)}" if stack
                     else f"rank {rank} left no stack (it had not finished starting up).")
    return "\n\n".join(parts)


def _replay_output(world_size: int, launch_dir: Path) -> None:
    """Copy each rank's output to ours, prefixed by rank, so pytest captures and shows it."""
    for rank in range(world_size):
        files = _rank_files(launch_dir, rank)
        for path, stream in ((files.stdout, sys.stdout), (files.stderr, sys.stderr)):
            text = _read_text(path)
            if text:
                stream.write("".join(f"[rank {rank}] {line}" for line in text.splitlines(keepends=True)))
                if not text.endswith("\n"):
                    stream.write("\n")
                stream.flush()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: tuple[Any, ...] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = 120.0,
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
    *,
    threads_per_rank: int | None = 1,
    start_method: str | None = None,
    expect_dead: Collection[int] = (),
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on `world_size` fresh processes; return their (picklable) results in rank order.

    Each rank starts with the default process group initialized (`backend`, a file rendezvous in a fresh temporary
    directory), ``torch.set_num_threads(threads_per_rank)`` applied (``None`` leaves torch's default), and the
    environment variables torchrun sets: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``
    and a free ``MASTER_PORT``, on top of this process's environment and `env`. The group is destroyed when `fn`
    returns. Each rank's stdout/stderr is copied to this process's, prefixed with ``[rank N]``, once the launch ends.
    A failure raises `DistributedTestError` (see the module docstring) once every rank is killed, so nothing hangs;
    `timeout` counts from the ranks' start.

    `start_method` is ``"forkserver"`` (default where available) or ``"spawn"``; the ``SHARDWISE_TEST_START_METHOD``
    environment variable sets the default. `expect_dead` lists ranks a fault-injection test kills on purpose: such a
    rank may end without a result (killed by a signal, or exiting) and its result is None; the launch waits for the
    others as usual. It still fails the launch if it raises.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"`world_size` must be a positive int, got {world_size!r}.")
    if not timeout > 0:
        raise ValueError(f"`timeout` must be a positive number of seconds, got {timeout!r}.")
    if threads_per_rank is not None and threads_per_rank < 1:
        raise ValueError(f"`threads_per_rank` must be a positive int or None, got {threads_per_rank!r}.")
    call = _pickle_call(fn, tuple(args), dict(kwargs or {}))
    environ = {**os.environ, **(env or {})}
    with _LAUNCH_LOCK:  # the forkserver start briefly changes os.environ
        ctx = _context(start_method)
    launch_dir = Path(tempfile.mkdtemp(prefix="shardwise-launch-"))
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # a port free now, for code reading MASTER_PORT
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        specs = [_RankSpec(rank, world_size, str(launch_dir), str(launch_dir / "rendezvous"), port, backend, timeout,
                           threads_per_rank, environ) for rank in range(world_size)]
        return _launch(ctx, specs, call, launch_dir, timeout, frozenset(expect_dead))
    finally:
        shutil.rmtree(launch_dir, ignore_errors=True)


def _launch(ctx: BaseContext, specs: Sequence[_RankSpec], call: bytes, launch_dir: Path,
            timeout: float, expect_dead: Collection[int] = ()) -> list[Any]:
    """Start, watch and always reap the ranks; turn a bad outcome into an error."""
    procs: list[BaseProcess] = []
    try:
        for spec in specs:  # each appended once it runs, so that `_kill_all` reaps only started ranks
            proc = ctx.Process(  # type: ignore[attr-defined]
                target=_rank_entry, args=(spec, call), name=f"shardwise-rank{spec.rank}")
            proc.start()
            procs.append(proc)
        # Counted from here: a forkserver's one-time warm-up is not the ranks' fault.
        deadline = time.monotonic() + timeout
        outcome = _watch(procs, deadline, launch_dir, expect_dead)
        if outcome.timed_out:
            _dump_stacks(procs, outcome.timed_out, launch_dir)
    finally:
        _kill_all(procs)
    _replay_output(len(specs), launch_dir)
    if outcome.failed:
        raise DistributedTestError(_crash_message(outcome, procs, launch_dir))
    if outcome.timed_out:
        raise DistributedTestError(_timeout_message(outcome, len(procs), launch_dir, timeout))
    results = (_rank_files(launch_dir, rank).result for rank in range(len(specs)))
    return [pickle.loads(path.read_bytes()) if path.exists() else None for path in results]  # None: died as expected


# --------------------------------------------------------------------------- pytest decorator


@dataclass(frozen=True)
class _FunctionRef:
    """A picklable pointer to a decorated test body: its module (name and file) and qualname.

    The decorator replaces the module attribute with its wrapper, so pickle could not find
    the original function by name; the rank imports the module and unwraps it instead.
    """

    module: str
    qualname: str
    path: str | None

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> _FunctionRef:
        """Point at `fn`, refusing nested functions that no rank could import."""
        if "<locals>" in fn.__qualname__:
            raise TypeError(f"`@distributed_test` needs `{fn.__qualname__}` at module or class level so that each rank "
                            "can import it; move it out of the enclosing function.")
        code = getattr(fn, "__code__", None)
        return cls(fn.__module__, fn.__qualname__, code.co_filename if code else None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """In the rank: import the module, find the decorated test, run its original body."""
        target: Any = _import_module(self.module, self.path)
        for part in self.qualname.split("."):
            target = getattr(target, part)
        return getattr(target, _BODY_ATTR, target)(*args, **kwargs)


def _import_module(name: str, path: str | None) -> ModuleType:
    """Import a test module by name, or from its file when its name is not importable."""
    if name in sys.modules:
        return sys.modules[name]
    try:
        return importlib.import_module(name)
    except ImportError:
        # pytest's importlib import mode gives test modules names sys.path cannot resolve.
        if path is None:
            raise
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import test module `{name}` from `{path}`.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def distributed_test(
    world_size: int | Callable[..., Any] = 2,
    timeout: float = 120.0,
    *,
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
    threads_per_rank: int | None = 1,
) -> Any:
    """Decorate a pytest test so that its body runs on `world_size` ranks via `run_distributed`.

    The test must be defined at module level (or as a method of a module-level class). Fixture and parametrize values
    are passed to every rank, so they must be picklable; the test passes when every rank returns. Usable bare or called
    (``@distributed_test(world_size=3, timeout=30)``). Ranks import the test module without pytest's assertion
    rewriting, so a failing ``assert a == b`` shows no values; prefer ``torch.testing.assert_close`` or a message.
    """
    if callable(world_size):
        return distributed_test()(world_size)

    def decorate(fn: _F) -> _F:
        ref = _FunctionRef.of(fn)

        @functools.wraps(fn)
        def launcher(*args: Any, **kwargs: Any) -> None:
            run_distributed(ref, world_size, args, kwargs, timeout=timeout, backend=backend,
                            env=env, threads_per_rank=threads_per_rank)

        setattr(launcher, _BODY_ATTR, fn)
        return launcher  # type: ignore[return-value]

    return decorate


# --------------------------------------------------------------------------- sub-cases


def run_subtests(fn: Callable[..., Any], cases: Iterable[Mapping[str, Any]], *, barrier: bool = True) -> None:
    """Run ``fn(**case)`` for each case inside a rank; report every failing case at once.

    Several cases per launch keep a suite fast: one launch costs far more than one case. A failing case does not stop
    the others; one AssertionError names each with its traceback. With a process group, all ranks meet at a barrier
    after each case (unless `barrier=False`) so a case that fails early on one rank does not mix its collectives with
    the next case's; a case that hangs a rank is caught by the launch `timeout`.
    """
    failures: list[tuple[Mapping[str, Any], str]] = []
    total = 0
    for case in cases:
        total += 1
        try:
            fn(**case)
        except Exception:  # noqa: BLE001 - collect every case's failure, then report
            failures.append((case, traceback.format_exc()))
        if barrier and (dist := _dist()):
            dist.barrier()
    if failures:
        where = f" on rank {dist.get_rank()}" if (dist := _dist()) else ""
        head = f"{len(failures)} of {total} subtests of `{getattr(fn, '__qualname__', fn)}` failed{where}:"
        body = [f"--- case {dict(case)!r} ---\n{tb.rstrip()}" for case, tb in failures]
        raise AssertionError("\n\n".join([head, *body]))
