"""The GPU tier: what runs here, and why a test is skipped.

Every test in this folder takes a ``device`` (``"cpu"`` or ``"cuda"``); the
``cuda`` cases carry the ``cuda`` marker and are skipped where torch sees no
CUDA GPU, with the reason "needs a CUDA GPU".  The ``cpu`` cases of the cheap
tests run in the regular suite, so a test body that only works on one kind of
device is noticed without a GPU.  ``pytest -m cuda tests/gpu`` runs the tier
(``tests/gpu/run.sh`` on the device).

The tests here compare runs to the bit (a checkpoint round trip, async
against blocking launches), so they run with deterministic kernels:
``torch.use_deterministic_algorithms(True, warn_only=True)`` (an op without a
deterministic kernel warns instead of failing; flash attention's backward,
which accumulates with atomics, takes its deterministic path), with cuBLAS's
workspace fixed as that mode needs.  It also fills ``torch.empty`` memory
with NaN, so a read of memory never written shows.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# the shared test helpers (`_parity`, ...) live one folder up
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# read when cuBLAS starts, so before any test runs; deterministic mode asks for it
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture(autouse=True)
def _deterministic() -> Iterator[None]:
    """Deterministic kernels for this folder's tests (see the module docstring); the mode before is restored."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
