"""Read ahead and write behind, with at most ``count`` buffers alive: the offloaded step's I/O pipeline.

One background thread does every read and write in the order asked (a disk serves one stream best, and order
keeps a sub-group's write before any later read of it).  The caller steps sub-group ``i`` while the thread
writes ``i - 1`` and reads ``i + 1 ... i + count - 2``; host memory never holds more than ``count`` sub-groups.
"""

from __future__ import annotations

import queue
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

__all__ = ["BufferPool", "pipelined"]

#: fills a buffer with sub-group ``index``'s bytes
Read = Callable[[int, torch.Tensor], None]
#: steps sub-group ``index`` in its buffer and returns what writes it back
Step = Callable[[int, torch.Tensor], Callable[[], None]]


class BufferPool:
    """``count`` reusable byte buffers, each grown to the largest size asked of it."""

    def __init__(self, count: int, nbytes: int = 0, pin: bool = False) -> None:
        self.count = count
        self.pin = pin
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        # Sized up front for the state expected: growing them later would leave the old ones to the
        # allocator, which keeps freed heap memory resident (see docs/offload.md).
        for _ in range(count):
            self._free.put(torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin))

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` (waits for one to come back from a write)."""
        buffer = self._free.get()
        if buffer.numel() < nbytes:
            try:
                buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
            except BaseException:
                self._free.put(buffer)  # out of memory: the pool keeps its count, or a later take waits forever
                raise
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        self._free.put(buffer)

    def nbytes(self) -> int:
        """Bytes the free buffers hold (all of them, between steps)."""
        held = [self._free.get() for _ in range(self.count)]
        for buffer in held:
            self._free.put(buffer)
        return sum(b.numel() for b in held)


def pipelined(order: Sequence[int], sizes: Sequence[int], pool: BufferPool, read: Read, step: Step,
              meanwhile: Callable[[], None] = lambda: None) -> None:
    """Run ``step`` over the sub-groups in ``order``, each read ahead into a pool buffer and written behind;
    ``meanwhile`` runs once the first reads are started, before the first step (work that needs no buffer:
    a partial offload's sub-groups in memory, stepped while the disk reads).

    Returns once every write is on disk.  The first error of a read, a step or a write is raised here, as
    soon as the loop sees it (a failed write is not followed by stepping every later sub-group first), and
    every buffer is back in ``pool`` by then, so the next call does not wait for one that never returns.
    """
    ahead = max(1, pool.count - 1)  # one buffer is the one being stepped
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwise-offload-io") as io:
        reads: dict[int, tuple[Future[None], torch.Tensor]] = {}
        writes: list[Future[None]] = []

        def start_read(position: int) -> None:
            index = order[position]
            buffer = pool.take(sizes[index])
            reads[position] = (_submit(io, pool, buffer, read, index, buffer), buffer)

        try:
            for position in range(min(ahead, len(order))):
                start_read(position)
            meanwhile()
            for position, index in enumerate(order):
                future, buffer = reads.pop(position)
                try:
                    future.result()
                    write = step(index, buffer)
                except BaseException:
                    pool.give(buffer)
                    raise
                writes = _unfinished([*writes, _submit(io, pool, buffer, _then_give, write, pool, buffer)])
                if position + ahead < len(order):
                    start_read(position + ahead)
        finally:
            # On an error too: every read in flight ends and gives its buffer back, so the next step (or
            # `memory_breakdown`) never waits on a buffer that will not come back.
            for future, buffer in reads.values():
                try:
                    future.result()
                except BaseException:  # noqa: BLE001 - the first error is the one raised
                    pass
                pool.give(buffer)
        for done in writes:
            done.result()


def _submit(io: ThreadPoolExecutor, pool: BufferPool, buffer: torch.Tensor, call: Callable[..., None],
            *args: Any) -> Future[None]:
    """``io.submit(call, *args)``, giving ``buffer`` back if it cannot be queued (an interrupt, shutdown at exit)."""
    try:
        return io.submit(call, *args)
    except BaseException:
        pool.give(buffer)
        raise


def _unfinished(writes: list[Future[None]]) -> list[Future[None]]:
    """The writes still to finish; raises the error of the first that failed (its buffer went back already).

    Finished ones are dropped, so each check looks at no more than the pool's buffers."""
    pending = []
    for write in writes:
        if not write.done():
            pending.append(write)
        elif write.exception() is not None:  # judged once: a write ending meanwhile is kept, not lost
            raise write.exception()  # type: ignore[misc]
    return pending


def _then_give(write: Callable[[], None], pool: BufferPool, buffer: torch.Tensor) -> None:
    try:
        write()
    finally:
        pool.give(buffer)
