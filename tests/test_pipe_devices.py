"""Everything a pipeline stage sends or receives travels on the stages' device.

NCCL moves CUDA tensors only, so a stage header, a received buffer or a
gathered weight made on the CPU fails a pipeline on GPUs and nowhere else.
A comm that records the device of each tensor it is handed (the meta device
standing in for a GPU) shows where they are made, on a machine without one.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardwise.pipe.p2p import Channel, gather_to_first

META = torch.device("meta")


class Recorder:
    """The point-to-point part of a Comm, recording ``(op, device)``; a receive stops the caller after that."""

    def __init__(self, gathered: Any = None) -> None:
        self.seen: list[tuple[str, torch.device]] = []
        self.rank = 0
        self.gathered = gathered

    def isend(self, tensor: torch.Tensor, dst: int) -> None:
        self.seen.append(("send", tensor.device))

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.seen.append(("send", tensor.device))

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        self.seen.append(("recv", tensor.device))
        raise StopIteration  # nothing real arrives: the device is what this test is after

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.gathered


def test_stage_headers_and_activations_travel_on_the_stages_device() -> None:
    comm = Recorder()
    channel = Channel(comm, stage=1, num_stages=3, device=META)  # type: ignore[arg-type]
    channel.send_activation((torch.empty(2, 3, device=META), torch.empty(2, device=META)))
    assert comm.seen == [("send", META)] * 3  # the header, then each tensor
    with pytest.raises(StopIteration):
        channel.recv_activation()
    assert comm.seen[-1] == ("recv", META)


def test_gathered_weights_travel_on_the_stages_device() -> None:
    later = Recorder()
    later.rank = 1
    gather_to_first(later, later, {"w": torch.zeros(3)}, META)  # type: ignore[arg-type]  # a CPU copy, as full_state_dict makes
    assert later.seen == [("send", META)]
    first = Recorder(gathered=[[], [("w", [3], 0)]])
    with pytest.raises(StopIteration):
        gather_to_first(first, first, {}, META)  # type: ignore[arg-type]
    assert first.seen == [("recv", META)]
