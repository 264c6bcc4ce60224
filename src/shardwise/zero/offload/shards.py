"""Stage 3's local shards apart from the model: in host memory for a model on an accelerator (``offload_param: {device:
cpu}``), or in a file (``nvme``) with at most ``max_in_cpu`` elements in memory.

Host memory (:class:`HostShard`, a :class:`~..stage3.params.ShardStorage`): each shard lives pinned in host memory;
reading ``unit.shard`` gives a device copy (read ahead ``buffer_count`` units past the gatherer's prefetch, on a
stream of its own, else made then), which goes once no view of it is held (:meth:`~..stage3.params.Unit.shard_released`),
written back first if torch's version counter says it was written.  On a CPU job under
:func:`~..store.plan.host_path_on_cpu` the "device" copy is a second host tensor, so the CPU suite runs this path.

A file (:class:`NvmeShard`): each shard is a run of bytes in one ``params`` file (:class:`~.files.NvmeFiles`), brought
into a host copy of its own at each read (a view of a copy that left keeps its memory rather than pointing at freed
memory).  For a model on an accelerator (:class:`FileShardOnDevice`) the file and its host copy are the home of a
device copy as above (docs/offload.md, "Parameters in a file on a GPU job").  When copies leave, and why a failed
read never becomes a copy, is in docs/offload.md ("Parameters: the shard's storage", "Failed reads").
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Protocol, Sequence

import torch

from ..store.plan import moves_to_host
from .files import NvmeFiles, OffloadIOError

__all__ = [
    "DeviceCopy", "FileShardOnDevice", "HostShard", "HostShards", "NvmeShard", "ShardCache", "offloads_params",
    "params_home", "shard_cache",
]

_KEY = "zero_optimization.offload_param.nvme_path"


class Gathers(Protocol):
    """What owns a shard (a unit): whether the shard must stay now (an all-gather reads it, a step publishes
    into it), and how errors name it."""

    @property
    def shard_busy(self) -> bool: ...

    @property
    def label(self) -> str: ...


class HostShards:
    """This rank's shards in host memory, or in a file with host copies (``cache``), and the stream their copies ahead
    run on (see the module docstring)."""

    def __init__(self, device: torch.device, pin: bool, cache: Optional["ShardCache"] = None) -> None:
        self.device = device
        self.pin = pin and device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        #: the file behind the host copies (``offload_param: {device: nvme}`` on an accelerator), or None
        self.cache = cache
        if cache is not None:
            cache.pin = self.pin  # its host copies are what the copies up read: pinned, they overlap
        self._closing = False
        #: bytes copied up (host to device) and down (written back), and uses that found their copy up made ahead
        self.up, self.down, self.ahead_hits = 0, 0, 0

    @property
    def closing(self) -> bool:
        """Set by `engine.destroy()` (as the file cache's): nothing is written back any more."""
        return self._closing

    @closing.setter
    def closing(self, value: bool) -> None:
        self._closing = value
        if self.cache is not None:
            self.cache.closing = value

    def place(self, shard: torch.Tensor, owner: Gathers) -> "DeviceCopy":
        """``shard`` (on the device) moves to host memory, or to the file; its device copy goes once released."""
        home = torch.empty(shard.shape, dtype=shard.dtype, pin_memory=self.pin)
        home.copy_(shard)
        if self.cache is None:
            return HostShard(self, home, shard, owner)
        return FileShardOnDevice(self, self.cache.place(home, owner), shard, owner)

    def check_usable(self) -> None:
        """Host memory does not lose what was written to it; a file may (:meth:`ShardCache.check_usable`)."""
        if self.cache is not None:
            self.cache.check_usable()

    def close(self) -> None:
        """Nothing to delete for host memory (the shards go with their units); a file's folder goes."""
        if self.cache is not None:
            self.cache.close()


class DeviceCopy:
    """One unit's shard apart from the model, and its copy on the device while in use (see the module docstring);
    where the shard lives is the subclass's: host memory (:class:`HostShard`) or a file (:class:`FileShardOnDevice`)."""

    def __init__(self, shards: HostShards, copy: torch.Tensor, owner: Gathers) -> None:
        self.shards, self.owner = shards, owner
        self.dtype, self.shape = copy.dtype, copy.shape
        self.nbytes = copy.numel() * copy.element_size()
        #: the copy on the device (None: only in host memory), and its version when it last agreed with the host's
        self.copy: Optional[torch.Tensor] = copy
        self.clean = copy._version
        #: a copy up started ahead, and the event it ends with (None on a CPU job)
        self.pending: Optional[tuple[torch.Tensor, Optional[torch.cuda.Event]]] = None

    @property
    def device(self) -> torch.device:
        return self.shards.device

    def _host(self) -> torch.Tensor:
        """The host values, waited for."""
        raise NotImplementedError

    def _host_now(self) -> Optional[torch.Tensor]:
        """The host values if at hand without waiting, else None."""
        raise NotImplementedError

    def _write_home(self, parts: Sequence[tuple[int, torch.Tensor]]) -> None:
        raise NotImplementedError

    def _home_used(self) -> None:
        """The host values were read or written: a file's cache may let them go."""

    def get(self) -> torch.Tensor:
        if self.copy is None:
            if self.pending is not None:
                copy, done = self.pending
                self.pending = None
                if done is not None:  # the compute stream waits for the copy, and owns its memory from here
                    stream = torch.cuda.current_stream(self.device)
                    stream.wait_event(done)
                    copy.record_stream(stream)
                self._take(copy)
                self.shards.ahead_hits += 1
            else:
                self._take(self._host().to(self.device, non_blocking=self.shards.pin, copy=True))
                self._home_used()
        assert self.copy is not None
        return self.copy

    def _take(self, copy: torch.Tensor) -> None:
        self.copy, self.clean = copy, copy._version
        self.shards.up += self.nbytes

    def put(self, shard: torch.Tensor) -> None:
        if shard is self.copy:
            return
        if shard.dtype != self.dtype or shard.shape != self.shape:
            raise RuntimeError(
                f"a stage 3 shard kept apart from the model (`offload_param`) cannot become a "
                f"{shard.dtype} tensor of shape {tuple(shard.shape)} (it is {self.dtype}, "
                f"{tuple(self.shape)}); cast the model before `shardwise.initialize`, not after")
        self.get().copy_(shard)

    def write(self, parts: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Into the device copy where there is one (written back when it goes), else into the home."""
        if self.copy is None:
            self.pending = None  # a copy ahead would miss these values: the next use copies them up
            self._write_home(parts)
            self._home_used()
        elif parts:
            torch._foreach_copy_([self.copy.narrow(0, at, v.numel()) for at, v in parts], [v for _, v in parts],
                                 non_blocking=True)

    def released(self) -> None:
        """The device copy goes (written back if written), unless an all-gather reads it or a step publishes."""
        if self.copy is None or self.owner.shard_busy:
            return
        if self.copy._version != self.clean and not self.shards.closing:
            self._write_home([(0, self.copy)])  # (a file's shard not in host memory: into the file, nothing read)
            self.shards.down += self.nbytes
        self.copy = None
        self._home_used()

    def read_ahead(self) -> None:
        if self.copy is not None or self.pending is not None:
            return
        host = self._host_now()
        if host is None:
            return  # (a file's read ahead into host memory started: a later call copies it up)
        stream = self.shards.stream
        if stream is None:
            self.pending = (host.clone(), None)
            return
        with torch.cuda.stream(stream):
            copy = host.to(self.device, non_blocking=self.shards.pin)
            done = torch.cuda.Event()
            done.record(stream)
        self.pending = (copy, done)

    def settle_read_ahead(self) -> None:
        """A copy ahead its gather did not take (the pass went another way) is let go."""
        self.pending = None

    def held_bytes(self) -> int:
        """Bytes on the device (the copy, or one coming ahead)."""
        return self.nbytes if self.copy is not None or self.pending is not None else 0

    def discard(self) -> None:
        self.copy, self.pending = None, None


class HostShard(DeviceCopy):
    """One unit's shard in (pinned) host memory, ``home``: ``offload_param: {device: cpu}`` on an accelerator."""

    def __init__(self, shards: HostShards, home: torch.Tensor, copy: torch.Tensor, owner: Gathers) -> None:
        super().__init__(shards, copy, owner)
        self.home = home

    def _host(self) -> torch.Tensor:
        return self.home

    def _host_now(self) -> Optional[torch.Tensor]:
        return self.home

    def _write_home(self, parts: Sequence[tuple[int, torch.Tensor]]) -> None:
        if parts:  # (waited for: the values may come from the device)
            torch._foreach_copy_([self.home.narrow(0, at, v.numel()) for at, v in parts], [v for _, v in parts])


class FileShardOnDevice(DeviceCopy):
    """One unit's shard in a file, with a host copy as the cache decides (an :class:`NvmeShard`, ``home``) and a copy
    on the device while in use: ``offload_param: {device: nvme}`` on an accelerator.  Read ahead in two calls of the
    gatherer's window: the first reads the file into host memory on the cache's thread, a later one copies it up."""

    def __init__(self, shards: HostShards, home: "NvmeShard", copy: torch.Tensor, owner: Gathers) -> None:
        super().__init__(shards, copy, owner)
        self.home = home

    def _host(self) -> torch.Tensor:
        return self.home.get()

    def _host_now(self) -> Optional[torch.Tensor]:
        return self.home.ready()

    def _write_home(self, parts: Sequence[tuple[int, torch.Tensor]]) -> None:
        self.home.write(parts)

    def _home_used(self) -> None:
        self.home.released()

    def settle_read_ahead(self) -> None:
        self.pending = None
        self.home.settle_read_ahead()

    def discard(self) -> None:
        super().discard()
        self.home.discard()


class ShardCache:
    """This rank's offloaded shards: one file, and the host copies of at most ``max_in_cpu`` elements of them."""

    def __init__(self, root: str, rank: int, numel: int, dtype: torch.dtype, max_in_cpu: int, ahead: int) -> None:
        self.files = NvmeFiles(root, rank, key=_KEY, label="offloaded parameter shards")
        nbytes = numel * dtype.itemsize
        self.files.reserve(nbytes, f"{numel:,} elements of {dtype}")  # what every rank of this host claims there
        self.files.create("params", nbytes)
        self.max_in_cpu = max_in_cpu
        #: host copies in pinned memory (set by :class:`HostShards` for a model on an accelerator)
        self.pin = False
        #: shards read ahead at most at once (``offload_param.buffer_count``)
        self.ahead = ahead
        self.used = 0  # bytes of the file given out
        self.capacity = nbytes
        #: the shards in host memory, least recently used first
        self.resident: OrderedDict[NvmeShard, None] = OrderedDict()
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwise-param-io")
        #: uses that found their shard read ahead, and uses that had to read it then (for the measurement)
        self.ahead_hits, self.misses = 0, 0
        #: set by `engine.destroy()`: the file is deleted next, so no host copy leaves (nor is written back)
        self.closing = False

    def place(self, shard: torch.Tensor, owner: Gathers) -> "NvmeShard":
        """A new run of the file for ``shard`` (written there); the host copy then leaves as the cache decides."""
        nbytes = shard.numel() * shard.element_size()
        if self.used + nbytes > self.capacity:
            raise RuntimeError(f"stage 3's offloaded shards outgrew the {self.capacity:,} bytes their file was laid "
                               "out for (a bug in shardwise); please report it")
        stored = NvmeShard(self, self.used, shard.contiguous(), owner)
        self.used += nbytes
        stored.write_back(force=True)
        self.touch(stored)
        return stored

    def touch(self, shard: "NvmeShard") -> None:
        self.resident[shard] = None
        self.resident.move_to_end(shard)

    def held_numel(self) -> int:
        return sum(s.numel for s in self.resident)

    def reading_ahead(self) -> int:
        return sum(1 for s in self.resident if s.pending is not None)

    def trim(self) -> None:
        """Shards leave host memory, least recently used first, until at most ``max_in_cpu`` elements remain."""
        if self.closing:
            return  # writing back into a file about to be deleted is wasted I/O
        held = self.held_numel()
        for shard in list(self.resident):
            if held <= self.max_in_cpu:
                return
            if shard.owner.shard_busy or shard.pending is not None:
                continue  # an all-gather reads it, a step publishes into it, or it was read ahead for a gather
            held -= shard.numel
            shard.evict()

    def check_usable(self) -> None:
        """Raise once the file lost this rank's shards (bytes changed under the job, cut short, removed): a step
        or a save then refuses, even where every shard it needs is in host memory."""
        self.files.check_usable()

    def close(self) -> None:
        """Wait for reads in flight and delete the folder (``engine.destroy()``; also done at exit)."""
        self.io.shutdown(wait=True)
        self.resident.clear()
        self.files.remove()


class NvmeShard:
    """One unit's shard: a run of the cache's file, and a host copy while it is resident (see the module docstring)."""

    def __init__(self, cache: ShardCache, offset: int, tensor: torch.Tensor, owner: Gathers) -> None:
        self.cache, self.offset, self.owner = cache, offset, owner
        self.shape, self.dtype, self._device = tensor.shape, tensor.dtype, tensor.device
        self.numel = tensor.numel()
        #: the host copy (None: only in the file)
        self.tensor: Optional[torch.Tensor] = tensor
        self.clean = -1  # its version counter when it and the file last agreed (-1: never)
        self.pending: Optional[Future[torch.Tensor]] = None

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def _where(self) -> str:
        return f"the shard of {self.owner.label}"  # what an I/O error names besides the file

    def get(self) -> torch.Tensor:
        if self.pending is not None:
            self._take(self._finish_read_ahead(self.pending))
            self.cache.ahead_hits += 1
        tensor = self.tensor
        if tensor is None:
            tensor = self._read()
            self._take(tensor)  # only now: a read that raised left nothing behind
            self.cache.misses += 1
        self.cache.touch(self)
        return tensor

    def put(self, shard: torch.Tensor) -> None:
        if shard is self.tensor:
            return
        if shard.dtype != self.dtype or shard.shape != self.shape:
            raise RuntimeError(
                f"a stage 3 shard kept in a file (`offload_param: {{device: nvme}}`) cannot become a "
                f"{shard.dtype} tensor of shape {tuple(shard.shape)} (it is {self.dtype}, {tuple(self.shape)}); "
                "cast the model before `shardwise.initialize`, not after")
        self.get().copy_(shard)

    def write(self, parts: Sequence[tuple[int, torch.Tensor]]) -> None:
        self.cache.check_usable()  # a step publishing into shards whose file lost them refuses, resident or not
        if self.pending is not None:
            self._settle(self.pending)  # a failed read ahead is dropped: the parts go to the file instead
        if self.tensor is not None:
            shard = self.get()  # in host memory: written there, written back when it leaves
            for at, values in parts:
                shard.narrow(0, at, values.numel()).copy_(values)
            return
        for at, values in parts:  # only in the file: the parts go there, nothing is read
            cast = values.detach().to("cpu", self.dtype).contiguous()  # (from a device copy written back too)
            self.cache.files.write_from("params", cast, self.offset + at * self.dtype.itemsize, where=self._where)

    def released(self) -> None:
        self.cache.trim()

    def ready(self) -> Optional[torch.Tensor]:
        """The host copy if it is at hand without waiting (a read ahead that succeeded is taken); else None, a read
        ahead started if there is none (a failed one is left for :meth:`get` to raise, as it does)."""
        pending = self.pending
        if pending is not None and not (pending.done() and pending.exception() is None):
            return None
        if pending is None and self.tensor is None:
            self.read_ahead()
            return None
        return self.get()

    def read_ahead(self) -> None:
        if self.tensor is not None or self.pending is not None or self.cache.reading_ahead() >= self.cache.ahead:
            return
        self.pending = self.cache.io.submit(self._read)
        self.cache.touch(self)

    def settle_read_ahead(self) -> None:
        """A read ahead no gather took (the pass went another way) becomes an ordinary host copy, which may
        leave now; one that failed is dropped (its values were never used: the next use reads the file)."""
        if self.pending is not None:
            self._settle(self.pending)
            self.cache.trim()

    def held_bytes(self) -> int:
        held = self.tensor is not None or self.pending is not None  # a read ahead's tensor exists already
        return self.numel * self.dtype.itemsize if held else 0

    def _read(self) -> torch.Tensor:
        """A fresh host copy read from the file (a new tensor each time: a view of an evicted one keeps its own
        memory alive); it becomes :attr:`tensor` only once the read succeeded (:meth:`_take`)."""
        tensor = torch.empty(self.shape, dtype=self.dtype, device=self._device, pin_memory=self.cache.pin)
        self.cache.files.read_into("params", tensor, self.offset, where=self._where)
        return tensor

    def _take(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.clean = tensor._version  # the read wrote through a byte view, which torch does not count

    def _settle(self, pending: Future[torch.Tensor]) -> None:
        """The read ahead ``pending`` ends without a use: cancelled, taken as the host copy, or dropped."""
        if pending.cancel():  # not started yet
            self._forget_read_ahead()
            return
        try:
            self._take(self._finish_read_ahead(pending))
        except OffloadIOError:
            pass  # nothing read is kept; a disk that keeps failing fails the next use, naming the unit

    def _finish_read_ahead(self, pending: Future[torch.Tensor]) -> torch.Tensor:
        """Wait for the read ahead ``pending``; a failed one is forgotten (so the next use reads again) and
        raised, saying so."""
        try:
            tensor = pending.result()
        except OffloadIOError as exc:
            self._forget_read_ahead()
            raise exc.extended("The read ahead was dropped: the next use of this shard reads it again") from exc
        except BaseException:  # (an interrupt too: the next use reads again)
            self._forget_read_ahead()
            raise
        self.pending = None
        return tensor

    def _forget_read_ahead(self) -> None:
        self.pending = None
        self.cache.resident.pop(self, None)

    def write_back(self, force: bool = False) -> None:
        """The host copy into the file, if anything wrote it since it last agreed with the file."""
        tensor = self.tensor
        if tensor is not None and (force or tensor._version != self.clean):
            self.cache.files.write_from("params", tensor, self.offset, where=self._where)
            self.clean = tensor._version

    def evict(self) -> None:
        """Write the host copy back if it was written, then let it go."""
        if self.pending is not None:
            self._settle(self.pending)  # (trim never evicts a shard read ahead; a direct call may)
        self.write_back()
        self.discard()

    def discard(self) -> None:
        """Let the host copy go unwritten (``engine.destroy()``: the unit's parameters hold its values now, and
        the file is deleted next); a read ahead in flight is waited for or cancelled first."""
        if self.pending is not None:
            self._settle(self.pending)
        self.tensor = None
        self.cache.resident.pop(self, None)


def offloads_params(zero_config: object) -> bool:
    """Whether ``zero_config`` asks for stage 3's shards outside the compute device's memory (``offload_param:
    {device: nvme}``, or ``cpu``, which moves them on a job on an accelerator): the gatherer then reads shards
    ahead, ``offload_param.buffer_count`` units past those it prefetches (a no-op for a shard in memory)."""
    section = getattr(zero_config, "offload_param", None)
    return section is not None and section.device in ("nvme", "cpu")


def params_home(zero_config: object, device: torch.device) -> Optional[str]:
    """Where ``zero_config`` keeps stage 3's shards of a model on ``device`` apart from it: ``nvme`` (files),
    ``cpu`` (host memory, where that moves them: :func:`~..store.plan.moves_to_host`), or None (with the model)."""
    section = getattr(zero_config, "offload_param", None)
    if section is None or (section.device == "cpu" and not moves_to_host(device)):
        return None
    return str(section.device)


def shard_cache(zero_config: object, rank: int, numel: int, dtype: torch.dtype,
                device: torch.device) -> Optional[ShardCache | HostShards]:
    """Where up to ``numel`` shard elements of ``dtype`` of a model on ``device`` live apart from it
    (:func:`params_home`): a file and its host cache, host memory, or None (in memory, with the model)."""
    where = params_home(zero_config, device)
    if where is None:
        return None
    section = getattr(zero_config, "offload_param")  # noqa: B009 - typed object, checked above
    if where == "cpu":
        return HostShards(device, bool(section.pin_memory))
    cache = ShardCache(str(section.nvme_path), rank, numel, dtype, int(section.max_in_cpu), int(section.buffer_count))
    # on an accelerator (or a CPU job on the host path) the file and its host copies sit behind a device copy
    return HostShards(device, bool(section.pin_memory), cache) if moves_to_host(device) else cache
