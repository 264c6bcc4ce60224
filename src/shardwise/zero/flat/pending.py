"""Stages 1-2: the all-gather of updated parameters runs behind the next forward.

After ``step()`` each rank holds updated values only for its own slice of
every bucket; one all-gather per bucket brings the others'.  torch's
``ZeroRedundancyOptimizer`` waits for its broadcasts inside ``step()``.  Here
the gathers are started in forward order and ``step()`` returns at once; a
bucket is waited for only when one of its parameters is first used, so the
first layers compute while the later layers' values are still arriving.

"Used" means any torch function applied to the parameter: the module's own
forward, a parent reading a child's weight through ``F.linear``, ``state_dict()``,
a user's ``p.norm()`` in a callback, ``.data``.  While its bucket is in
flight a parameter's class is :class:`GatheringParameter`, whose
``__torch_function__`` waits for the bucket and turns the bucket's parameters
back into plain ``nn.Parameter`` before the function runs, so code that reads
parameters between ``step()`` and the next forward sees the updated values,
as with DDP.  Reading or setting ``.grad`` and reading ``.requires_grad``
are not uses: they touch no values and do not wait.  Once every bucket has
been waited for, no parameter is special and the hot path costs nothing.  The strategy waits for everything itself
before anything that writes parameters or master weights (backward, the next
step, loading, changing the trainable set, closing).
"""

from __future__ import annotations

import inspect
from typing import Any, Iterator, Optional

import torch
from torch import nn

from ...comm.distributed import Work

__all__ = ["GatheringParameter", "PendingGathers"]

#: where a parameter in flight keeps (its PendingGathers, its bucket index)
_KEY = "_shardwise_gathering"


def _attribute(name: str) -> Any:
    """The descriptor behind ``Tensor.<name>``: what ``__torch_function__`` receives as ``func``."""
    return inspect.getattr_static(torch.Tensor, name)


#: what reads or sets a parameter's bookkeeping, not its values: these run without waiting
#: (``zero_grad`` and the trainable-set check touch every parameter while gathers are in flight)
_NOT_A_USE = frozenset({_attribute("grad").__get__, _attribute("grad").__set__, _attribute("requires_grad").__get__})


class GatheringParameter(nn.Parameter):
    """A parameter whose bucket's all-gather is still in flight (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Optional[dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if func not in _NOT_A_USE:
            for param in _in_flight(args, kwargs):
                param._arrive()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def _arrive(self) -> None:
        """Wait for this parameter's bucket (it and its bucket become plain Parameters)."""
        entry = self.__dict__.get(_KEY)
        if entry is not None:
            entry[0].wait_bucket(entry[1])

    # A copy or a pickle of a parameter in flight is of the arrived value, and a plain Parameter.
    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Parameter:
        self._arrive()
        return nn.Parameter.__deepcopy__(self, memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        self._arrive()
        return nn.Parameter.__reduce_ex__(self, protocol)


def _in_flight(args: Any, kwargs: dict[str, Any]) -> Iterator[GatheringParameter]:
    stack = [*args, *kwargs.values()]
    while stack:
        item = stack.pop()
        if type(item) is GatheringParameter:
            yield item
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


class PendingGathers:
    """The buckets whose all-gather was started and not yet waited for, with their parameters."""

    def __init__(self) -> None:
        self._works: dict[int, tuple[Work, list[torch.Tensor]]] = {}

    def start(self, index: int, work: Work, params: list[torch.Tensor]) -> None:
        """Bucket ``index`` is being gathered by ``work`` into ``params``: guard them until it is done."""
        if any(type(p) is not nn.Parameter for p in params):
            work.wait()  # a Parameter subclass of the user's keeps its class: no overlap for its bucket
            return
        self._works[index] = (work, params)
        for param in params:
            param.__dict__[_KEY] = (self, index)
            param.__class__ = GatheringParameter

    def wait_bucket(self, index: int) -> None:
        """Finish bucket ``index``'s gather (nothing if it is done); its parameters become plain again."""
        entry = self._works.pop(index, None)
        if entry is None:
            return
        work, params = entry
        for param in params:
            param.__class__ = nn.Parameter
            param.__dict__.pop(_KEY, None)
        work.wait()

    def wait_all(self) -> None:
        """Finish every gather in flight, in the order they were started."""
        for index in list(self._works):
            self.wait_bucket(index)
