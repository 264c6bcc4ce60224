"""What every test gets: no process group outlives the test that made it.

A one-process test that calls `shardwise.deepspeed.initialize` or `init_distributed` creates a 1-rank group in the
pytest process itself; left alive, it changes what later tests see (`run_subtests` reports per rank, DeepSpeed's
`comm` answers from the group), so results would depend on test order.
"""

from __future__ import annotations

from typing import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_leftover_process_group() -> Iterator[None]:
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
