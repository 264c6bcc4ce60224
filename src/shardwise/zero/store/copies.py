"""Between the model's device and host memory: reduced gradients down as they land, updated values up in the
compute dtype (the master store's host home, and its NVMe home on a job on an accelerator; docs/offload.md).

Down.  The home keeps one pinned fp32 gradient buffer in host memory laid out as its part of the shard; a
piece's key has its view of it as ``.grad``.  As a bucket (flat stages) or unit (stage 3) of reduced gradients
lands, its pieces are copied down on a stream of their own (CUDA), overlapping what runs after; the step waits
for them first (:meth:`DeviceCopies.wait`).

* The flat stages' reduced gradients stay on the device (the norm is taken there), each piece's registered
  once per layout (:meth:`DeviceCopies.register`).  A write after its copy (a script scaling its gradients, a
  second reduction) is seen by the version counter at :meth:`DeviceCopies.wait`, which copies again.  (The
  counter is shared by every view of one buffer, so each copy takes it as it is after its bucket landed.)
* Stage 3's first reduction of a step is scaled on the device into a temporary, whose norm is taken there
  (:attr:`DeviceCopies.norms`) and which is copied down (:meth:`DeviceCopies.down_fresh`).

Up.  Updated fp32 masters are cast on the host into pinned staging of the compute dtype (two buffers of at
most :data:`STAGE` elements, in turn, each refilled once its copy finished) and written into the model without
waiting (:meth:`DeviceCopies.publish`): the copy runs while the host steps the next sub-group.

On a CPU job under :func:`.plan.host_path_on_cpu` the "device" is host memory too, with plain copies and no
stream or event, so the CPU suite runs every line but the CUDA calls.  :attr:`DeviceCopies.moved` counts the
bytes each way (benchmarks.offload compares them with theory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Optional, Sequence

import torch

__all__ = ["STAGE", "DeviceCopies", "Moved"]

#: elements of one staging buffer for the copies up (32 MiB in bf16): large enough that a copy's fixed cost is
#: small against its bytes, small enough that two of them are nothing beside the state
STAGE = 1 << 24

#: ``write(runs)``: a stage's side of the store taking updated values (``(piece, at, values)`` each)
Write = Callable[[Sequence[tuple[Any, int, torch.Tensor]]], None]


@dataclass
class Moved:
    """Bytes copied between the model's device and host memory."""

    down: int = 0
    up: int = 0


class DeviceCopies:
    """The gradient buffer in host memory and the copies to and from ``device`` (see the module docstring)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, pin: bool) -> None:
        self.device, self.dtype = device, dtype
        self.pin = pin and device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        #: the fp32 gradients of the pieces apart, from shard element ``base`` on
        self.grads = torch.empty(0)
        self.base = 0
        #: per registered piece: its view of :attr:`grads`, the device gradient it copies, its version when copied
        self._sources: dict[Hashable, tuple[torch.Tensor, torch.Tensor]] = {}
        self._copied: dict[Hashable, int] = {}
        #: stage 3: per piece, the norm of the gradient copied down, taken on the device
        self.norms: dict[Hashable, torch.Tensor] = {}
        self._staging: list[torch.Tensor] = []
        self._fences: list[Optional[torch.cuda.Event]] = []
        self._turn = 0
        self.moved = Moved()

    def plan(self, base: int, numel: int) -> None:
        """A gradient buffer for ``numel`` elements of the shard from element ``base`` on."""
        self.base = base
        self.grads = torch.zeros(numel, dtype=torch.float32, pin_memory=self.pin)

    def view(self, at: int, numel: int) -> torch.Tensor:
        """Elements ``[at, at + numel)`` of the shard in the host gradient buffer."""
        return self.grads.narrow(0, at - self.base, numel)

    def register(self, owner: Hashable, view: torch.Tensor, source: torch.Tensor) -> None:
        """``view`` (of the host buffer) copies ``source`` (a fixed device gradient) when ``owner`` arrives."""
        self._sources[owner] = (view, source)

    def down(self, owners: Iterable[Hashable]) -> None:
        """Start copying the registered gradients of ``owners`` down (their reduction landed)."""
        pairs = [pair for owner in owners if (pair := self._sources.get(owner)) is not None]
        self.down_fresh(pairs)
        for owner in self._copied.keys() | {owner for owner in owners if owner in self._sources}:
            self._copied[owner] = self._sources[owner][1]._version  # (the landing buckets' writes are the reduction's)

    def down_fresh(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Start copying each ``(view, source)`` down (a registered gradient, or one made for this copy only)."""
        if not pairs:
            return
        if self.stream is None:
            for host, source in pairs:
                host.copy_(source)
        else:  # after what the current stream queued (the reduction), beside what it queues next
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                for host, source in pairs:
                    host.copy_(source, non_blocking=True)
                    source.record_stream(self.stream)  # a temporary is not reused before its copy ran
        self.moved.down += sum(source.numel() * source.element_size() for _, source in pairs)

    def wait(self) -> None:
        """Every copy down finished; registered gradients written since their copy are copied again."""
        if self.stream is not None:
            self.stream.synchronize()
        stale = [owner for owner, version in self._copied.items() if self._sources[owner][1]._version != version]
        if stale:
            self.down_fresh([self._sources[owner] for owner in stale])
            if self.stream is not None:
                self.stream.synchronize()
            self.restamp()

    def restamp(self) -> None:
        """The registered gradients' writes so far were the home's own (the device's share scaled, its copies
        current): only writes after now are a script's."""
        for owner in self._copied:
            self._copied[owner] = self._sources[owner][1]._version

    def publish(self, write: Write, runs: Sequence[tuple[Any, int, torch.Tensor]]) -> None:
        """Updated fp32 ``runs`` (in host memory) into the model through ``write``, cast on the host into staging
        buffers of the compute dtype and copied up without waiting."""
        batch: list[tuple[Any, int, torch.Tensor]] = []
        buffer, used = None, 0
        for piece, at, values in runs:
            done = 0
            while done < values.numel():
                if buffer is None:
                    buffer, used = self._take(), 0
                count = min(values.numel() - done, buffer.numel() - used)
                staged = buffer.narrow(0, used, count)
                staged.copy_(values.narrow(0, done, count))
                batch.append((piece, at + done, staged))
                used, done = used + count, done + count
                if used == buffer.numel():
                    self._send(write, batch)
                    batch, buffer = [], None
        if batch:
            self._send(write, batch)

    def _take(self) -> torch.Tensor:
        """The next staging buffer in turn, once its last copy up finished."""
        turn = self._turn
        self._turn = (turn + 1) % 2
        if len(self._staging) <= turn:
            self._staging.append(torch.empty(STAGE, dtype=self.dtype, pin_memory=self.pin))
            self._fences.append(None)
        fence = self._fences[turn]
        if fence is not None:
            fence.synchronize()
        return self._staging[turn]

    def _send(self, write: Write, batch: list[tuple[Any, int, torch.Tensor]]) -> None:
        write(batch)
        self.moved.up += sum(values.numel() * values.element_size() for _, _, values in batch)
        if self.stream is not None:
            fence = torch.cuda.Event()
            fence.record(torch.cuda.current_stream(self.device))
            self._fences[(self._turn - 1) % 2] = fence

    def nbytes(self) -> int:
        """Host bytes of the gradient buffer and the staging buffers."""
        return sum(t.numel() * t.element_size() for t in (self.grads, *self._staging))
