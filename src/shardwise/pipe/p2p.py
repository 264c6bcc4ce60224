"""Activations forward and their gradients back, between neighbouring stages (docs/pipeline.md, "Activations
between stages"). All traffic goes through :class:`~shardwise.comm.distributed.Comm`, which counts the bytes.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm.distributed import Comm, Work

__all__ = ["Channel", "HEADER_SLOTS", "gather_to_first", "working_copy"]

#: int64 entries of one header: 2 + (3 + ndim) per tensor
HEADER_SLOTS = 40
_DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
]
_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}

Meta = tuple[torch.dtype, bool, tuple[int, ...]]


def _tensors(value: Any, what: str) -> tuple[bool, list[torch.Tensor]]:
    """``(is a tuple, its tensors)``; anything else in an activation is an error."""
    packed = isinstance(value, (tuple, list))
    items = list(value) if packed else [value]
    for index, item in enumerate(items):
        if not isinstance(item, torch.Tensor):
            where = f"element {index} of the {what}" if packed else f"the {what}"
            raise TypeError(
                f"{where} is a `{type(item).__name__}`: what passes between pipeline stages must be a tensor or "
                "a tuple of tensors; turn other values into tensors (or recompute them on the next stage)")
        if item.dtype not in _CODE:
            raise TypeError(f"the {what} holds a `{item.dtype}` tensor, which cannot cross stages; supported: {_DTYPES}")
    return packed, items


def _needs_grad(tensor: torch.Tensor) -> bool:
    return tensor.requires_grad and tensor.is_floating_point()


def _encode(packed: bool, tensors: list[torch.Tensor]) -> torch.Tensor:
    slots = [int(packed), len(tensors)]
    for tensor in tensors:
        slots += [_CODE[tensor.dtype], int(_needs_grad(tensor)), tensor.dim(), *tensor.shape]
    if len(slots) > HEADER_SLOTS:
        raise ValueError(
            f"an activation of {len(tensors)} tensors with {sum(t.dim() for t in tensors)} dimensions in all does "
            f"not fit the {HEADER_SLOTS}-entry stage header; pass fewer or flatter tensors between stages")
    header = torch.zeros(HEADER_SLOTS, dtype=torch.int64)
    header[: len(slots)] = torch.tensor(slots, dtype=torch.int64)
    return header


def _decode(header: torch.Tensor) -> tuple[bool, list[Meta]]:
    slots = header.tolist()
    packed, count, at = bool(slots[0]), slots[1], 2
    metas: list[Meta] = []
    for _ in range(count):
        code, grad, ndim = slots[at : at + 3]
        metas.append((_DTYPES[code], bool(grad), tuple(slots[at + 3 : at + 3 + ndim])))
        at += 3 + ndim
    return packed, metas


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """What goes on the wire: contiguous, detached, bool as bytes."""
    tensor = tensor.detach().contiguous()
    return tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor


def _recv(comm: Comm, shape: Any, dtype: torch.dtype, src: int, device: torch.device) -> torch.Tensor:
    """The tensor :func:`_wire` sent from ``src``."""
    wire = torch.empty(shape, dtype=torch.uint8 if dtype == torch.bool else dtype, device=device)
    comm.recv(wire, src)
    return wire.view(torch.bool) if dtype == torch.bool else wire


def working_copy(received: Any) -> Any:
    """What a stage computes on: each received tensor that needs a gradient, cloned.

    The received tensors are leaves (their ``.grad`` goes back to the previous stage), and autograd forbids an in-place
    op on a leaf that requires grad (a first ``ReLU(inplace=True)``); the layers may overwrite the clone (one copy, as
    DeepSpeed makes), and its gradient still flows into the leaf.
    """
    if not torch.is_grad_enabled():
        return received
    packed, tensors = _tensors(received, "stage input")
    copies = [t.clone() if t.requires_grad else t for t in tensors]
    return tuple(copies) if packed else copies[0]


class Channel:
    """This stage's links to the previous and next stage of its replica (group ranks = stages)."""

    def __init__(self, comm: Comm, stage: int, num_stages: int, device: torch.device) -> None:
        self.comm, self.stage, self.num_stages, self.device = comm, stage, num_stages, device
        self._sending: list[tuple[Work, torch.Tensor]] = []

    def _isend(self, tensor: torch.Tensor, dst: int) -> None:
        wire = _wire(tensor)
        self._sending.append((self.comm.isend(wire, dst), wire))  # keep the tensor alive until sent

    def send_activation(self, value: Any) -> None:
        """Send this stage's output to the next stage."""
        packed, tensors = _tensors(value, "stage output")
        self._isend(_encode(packed, tensors).to(self.device), self.stage + 1)  # NCCL sends CUDA tensors only
        for tensor in tensors:
            self._isend(tensor, self.stage + 1)

    def recv_activation(self) -> Any:
        """The previous stage's output; floating tensors that needed a gradient there need one here."""
        header = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=self.device)
        self.comm.recv(header, self.stage - 1)
        packed, metas = _decode(header)
        tensors = [_recv(self.comm, shape, dtype, self.stage - 1, self.device).requires_grad_(grad)
                   for dtype, grad, shape in metas]
        return tuple(tensors) if packed else tensors[0]

    def send_grads(self, inputs: Any) -> None:
        """Send the gradients of the received ``inputs`` back (zeros for an input the stage did not use)."""
        for tensor in _tensors(inputs, "stage input")[1]:
            if _needs_grad(tensor):
                self._isend(tensor.grad if tensor.grad is not None else torch.zeros_like(tensor), self.stage - 1)

    def recv_grads(self, outputs: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(outputs that need a gradient, their gradients)`` from the next stage."""
        wanting = [t for t in _tensors(outputs, "stage output")[1] if _needs_grad(t)]
        return wanting, [_recv(self.comm, t.shape, t.dtype, self.stage + 1, t.device) for t in wanting]

    def flush(self) -> None:
        """Wait for every send in flight (their tensors may then be freed)."""
        sending, self._sending = self._sending, []
        for work, _ in sending:
            work.wait()


def gather_to_first(p2p: Comm, pipe: Comm, tensors: dict[str, torch.Tensor],
                    device: torch.device) -> dict[str, torch.Tensor]:
    """Every stage's named ``tensors`` on the first stage (``{}`` elsewhere); collective over ``pipe``.

    Names already present keep the first stage's value (a tied weight on two stages).
    Only names, shapes and dtypes are pickled; the tensors go point to point, through ``device`` (the
    stages' device: NCCL moves CUDA tensors only) and land where the first stage's own ``tensors`` are.
    """
    described = [(name, list(t.shape), _CODE[t.dtype]) for name, t in tensors.items()]
    everyone = pipe.all_gather_object(described)
    if pipe.rank != 0:
        for tensor in tensors.values():
            p2p.send(_wire(tensor).to(device), 0)
        return {}
    merged = dict(tensors)
    home = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    for stage, entries in enumerate(everyone[1:], start=1):
        for name, shape, code in entries:
            merged.setdefault(name, _recv(p2p, shape, _DTYPES[code], stage, device).to(home))
    return merged
