"""Stage 3's local shards in host memory for a model on an accelerator (``offload_param: {device: cpu}``).

Each unit's shard lives in pinned host memory (:class:`HostShard`, a :class:`~..stage3.params.ShardStorage`).
Reading ``unit.shard`` gives a copy on the device: the one read ahead (``buffer_count`` units past those the
gatherer prefetches, on a stream of its own), else one made then, so the all-gather reads it on the device.
The device copy goes once no view of it is held (:meth:`~..stage3.params.Unit.shard_released`), written back
first if torch's version counter says it was written.  A step publishing into a shard with no device copy
writes host memory: the next gather takes it.  On a CPU job under :func:`~..store.plan.host_path_on_cpu` the
"device" copy is a second host tensor, so the CPU suite runs this path.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence

import torch

__all__ = ["HostShard", "HostShards"]


class _Owner(Protocol):
    """The unit a shard is of: whether its shard must stay (an all-gather reads it, a step publishes into it)."""

    @property
    def shard_busy(self) -> bool: ...


class HostShards:
    """This rank's shards in host memory, and the stream their copies ahead run on (see the module docstring)."""

    def __init__(self, device: torch.device, pin: bool) -> None:
        self.device = device
        self.pin = pin and device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        #: set by `engine.destroy()` (as the file cache's): nothing is written back any more
        self.closing = False
        #: bytes copied up (host to device) and down (written back), for the measurement
        self.up = 0
        self.down = 0

    def place(self, shard: torch.Tensor, owner: _Owner) -> "HostShard":
        """``shard`` (on the device) moves to host memory; its device copy goes once released."""
        home = torch.empty(shard.shape, dtype=shard.dtype, pin_memory=self.pin)
        home.copy_(shard)
        return HostShard(self, home, shard, owner)

    def check_usable(self) -> None:
        """Host memory does not lose what was written to it (the file cache's check has nothing to do here)."""

    def close(self) -> None:
        """Nothing to delete: the shards go with their units."""


class HostShard:
    """One unit's shard in host memory, and its copy on the device while in use (see the module docstring)."""

    def __init__(self, shards: HostShards, home: torch.Tensor, copy: torch.Tensor, owner: _Owner) -> None:
        self.shards, self.home, self.owner = shards, home, owner
        #: the copy on the device (None: only in host memory), and its version when it last agreed with the host's
        self.copy: Optional[torch.Tensor] = copy
        self.clean = copy._version
        #: a copy up started ahead, and the event it ends with (None on a CPU job)
        self.pending: Optional[tuple[torch.Tensor, Optional[torch.cuda.Event]]] = None

    @property
    def device(self) -> torch.device:
        return self.shards.device

    def get(self) -> torch.Tensor:
        if self.copy is None:
            if self.pending is not None:
                self._take_ahead()
            else:
                self._take(self.home.to(self.device, non_blocking=self.shards.pin, copy=True))
        assert self.copy is not None
        return self.copy

    def _take(self, copy: torch.Tensor) -> None:
        self.copy, self.clean = copy, copy._version
        self.shards.up += copy.numel() * copy.element_size()

    def _take_ahead(self) -> None:
        assert self.pending is not None
        copy, done = self.pending
        self.pending = None
        if done is not None:  # the compute stream waits for the copy, and owns its memory from here
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(done)
            copy.record_stream(stream)
        self._take(copy)

    def put(self, shard: torch.Tensor) -> None:
        if shard is self.copy:
            return
        if shard.dtype != self.home.dtype or shard.shape != self.home.shape:
            raise RuntimeError(
                f"a stage 3 shard kept in host memory (`offload_param: {{device: cpu}}`) cannot become a "
                f"{shard.dtype} tensor of shape {tuple(shard.shape)} (it is {self.home.dtype}, "
                f"{tuple(self.home.shape)}); cast the model before `shardwise.initialize`, not after")
        self.get().copy_(shard)

    def write(self, parts: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Into the device copy where there is one (written back when it goes), else into host memory."""
        target = self.copy if self.copy is not None else self.home
        if target is self.home:
            self.pending = None  # a copy ahead would miss these values: the next use copies them up
        if parts:  # (into host memory: waited for, the values may come from the device)
            torch._foreach_copy_([target.narrow(0, at, v.numel()) for at, v in parts], [v for _, v in parts],
                                 non_blocking=target is self.copy)

    def released(self) -> None:
        """The device copy goes (written back if written), unless an all-gather reads it or a step publishes."""
        if self.copy is None or self.owner.shard_busy:
            return
        if self.copy._version != self.clean and not self.shards.closing:
            self.home.copy_(self.copy)
            self.shards.down += self.home.numel() * self.home.element_size()
        self.copy = None

    def read_ahead(self) -> None:
        if self.copy is not None or self.pending is not None:
            return
        stream = self.shards.stream
        if stream is None:
            self.pending = (self.home.clone(), None)
            return
        with torch.cuda.stream(stream):
            copy = self.home.to(self.device, non_blocking=self.shards.pin)
            done = torch.cuda.Event()
            done.record(stream)
        self.pending = (copy, done)

    def settle_read_ahead(self) -> None:
        """A copy ahead its gather did not take (the pass went another way) is let go."""
        self.pending = None

    def held_bytes(self) -> int:
        """Bytes on the device (the copy, or one coming ahead)."""
        held = self.copy is not None or self.pending is not None
        return self.home.numel() * self.home.element_size() if held else 0

    def discard(self) -> None:
        self.copy, self.pending = None, None
