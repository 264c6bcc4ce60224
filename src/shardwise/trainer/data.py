"""Where the trainer's batches come from: a map-style dataset, an iterable dataset, or the user's DataLoader
(docs/trainer.md).

Every epoch can start at any micro-batch, which is what an exact resume needs. The loaders built here carry their own
generator, so starting an epoch draws nothing from torch's global RNG (a resumed run and an uninterrupted one see the
same random stream).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sized
from typing import Any, Callable, Optional

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, get_worker_info

__all__ = ["Source", "eval_source", "train_source"]

Collate = Optional[Callable[[list[Any]], Any]]


class _RankShard(IterableDataset):  # type: ignore[type-arg]
    """The items of ``dataset`` that belong to this rank (and to this worker of it)."""

    def __init__(self, dataset: Any, rank: int, world_size: int) -> None:
        self.dataset, self.rank, self.world_size = dataset, rank, world_size

    def __iter__(self) -> Iterator[Any]:
        worker = get_worker_info()
        workers, worker_id = (worker.num_workers, worker.id) if worker is not None else (1, 0)
        return itertools.islice(iter(self.dataset), self.rank * workers + worker_id, None, self.world_size * workers)


class Source:
    """Batches of one data source, epoch by epoch, from any micro-batch on."""

    def __init__(self, make: Callable[[int, int], Iterator[Any]], batches: Optional[int], samples: Optional[int]) -> None:
        self._make = make
        #: this rank's micro-batches per epoch; None when the source has no length (iterable data)
        self.batches_per_epoch = batches
        #: samples in the whole dataset (all ranks), when the trainer batches it
        self.samples = samples

    def epoch(self, epoch: int, skip: int = 0) -> Iterator[Any]:
        """Epoch ``epoch``'s batches for this rank, after its first ``skip`` micro-batches."""
        return self._make(epoch, skip)


def train_source(data: Any, *, micro: Optional[int], rank: int, world: int, seed: int,
                 collate_fn: Collate, num_workers: int) -> Source:
    """The training batches of ``data`` (see the module docstring)."""
    if isinstance(data, DataLoader):
        return _user_loader(data, collate_fn, num_workers)
    micro = _micro(micro, "train_data")
    if isinstance(data, IterableDataset):
        return _iterable(data, micro, rank, world, seed, collate_fn, num_workers, drop_last=True)
    _require_dataset(data, "train_data")
    sampler: DistributedSampler[Any] = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)

    def make(epoch: int, skip: int) -> Iterator[Any]:
        sampler.set_epoch(epoch)
        return iter(DataLoader(data, batch_size=micro, sampler=list(sampler)[skip * micro:], drop_last=True,
                               collate_fn=collate_fn, num_workers=num_workers, generator=_generator(seed, epoch)))

    return Source(make, len(sampler) // micro, len(data))


def eval_source(data: Any, *, micro: Optional[int], rank: int, world: int,
                collate_fn: Collate, num_workers: int) -> Source:
    """Evaluation batches: every sample once over all ranks, in order (rank ``r`` takes ``r, r+world, ...``)."""
    if isinstance(data, DataLoader):
        return _user_loader(data, collate_fn, num_workers)
    micro = _micro(micro, "eval_data")
    if isinstance(data, IterableDataset):
        return _iterable(data, micro, rank, world, 0, collate_fn, num_workers, drop_last=False)
    _require_dataset(data, "eval_data")
    indices = list(range(rank, len(data), world))

    def make(epoch: int, skip: int) -> Iterator[Any]:
        return iter(DataLoader(data, batch_size=micro, sampler=indices[skip * micro:], collate_fn=collate_fn,
                               num_workers=num_workers, generator=_generator(0, epoch)))

    return Source(make, -(-len(indices) // micro), len(data))


def _user_loader(loader: DataLoader, collate_fn: Collate, num_workers: int) -> Source:  # type: ignore[type-arg]
    if collate_fn is not None or num_workers:
        raise ValueError(
            "`collate_fn`/`num_workers` were passed with a DataLoader as `train_data`/`eval_data`; the trainer "
            "uses your DataLoader as built: give them to the `DataLoader(...)` itself")

    def make(epoch: int, skip: int) -> Iterator[Any]:
        _set_epoch(loader, epoch)
        return itertools.islice(iter(loader), skip, None)

    return Source(make, _length(loader), None)  # its batch size may not be the config's: count batches only


def _iterable(dataset: Any, micro: int, rank: int, world: int, seed: int, collate_fn: Collate,
              num_workers: int, drop_last: bool) -> Source:
    shard = _RankShard(dataset, rank, world)

    def make(epoch: int, skip: int) -> Iterator[Any]:
        _set_epoch(dataset, epoch)
        loader = DataLoader(shard, batch_size=micro, drop_last=drop_last, collate_fn=collate_fn,
                            num_workers=num_workers, generator=_generator(seed, epoch))
        return itertools.islice(iter(loader), skip, None)

    return Source(make, None, None)


def _generator(seed: int, epoch: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + epoch)


def _set_epoch(obj: Any, epoch: int) -> None:
    """Call ``set_epoch`` where the user's loader, sampler or dataset has one (DistributedSampler does)."""
    for candidate in (obj, getattr(obj, "sampler", None), getattr(getattr(obj, "batch_sampler", None), "sampler", None),
                      getattr(obj, "dataset", None)):
        if candidate is not None and callable(getattr(candidate, "set_epoch", None)):
            candidate.set_epoch(epoch)


def _length(obj: Any) -> Optional[int]:
    try:
        return len(obj) if isinstance(obj, Sized) else None
    except TypeError:  # an IterableDataset's loader raises here
        return None


def _micro(micro: Optional[int], what: str) -> int:
    if micro is None:
        raise ValueError(
            f"`{what}` is a dataset, so the trainer batches it, but the engine's config sets no batch size: add "
            "`train_micro_batch_size_per_gpu` (or `train_batch_size`) to the config, or pass a DataLoader")
    return micro


def _require_dataset(data: Any, what: str) -> None:
    if not (isinstance(data, Dataset) or hasattr(data, "__getitem__")) or _length(data) is None:
        raise TypeError(
            f"`{what}` of type `{type(data).__name__}` is not a dataset: pass a map-style `Dataset` (with "
            "`__len__` and `__getitem__`), an `IterableDataset`, or a `DataLoader`")
