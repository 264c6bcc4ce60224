"""The GPU tier: what runs here, and why a test is skipped.

Every test in this folder takes a ``device`` (``"cpu"`` or ``"cuda"``); the
``cuda`` cases carry the ``cuda`` marker and are skipped where torch sees no
CUDA GPU, with the reason "needs a CUDA GPU".  The ``cpu`` cases of the cheap
tests run in the regular suite, so a test body that only works on one kind of
device is noticed without a GPU.  ``pytest -m cuda tests/gpu`` runs the tier
(``tests/gpu/run.sh`` on the device).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# the shared test helpers (`_parity`, ...) live one folder up
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
