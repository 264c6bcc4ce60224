"""Non-blocking copies and side streams give the result the same job gives with ``CUDA_LAUNCH_BLOCKING=1``.

``_stream_job.py`` runs twice in fresh processes, once as is and once with
every kernel launch synchronous; with deterministic kernels the weights must be
equal to the bit.  A copy read before it lands, or a stream not waited on,
shows up as a difference (or as a crash) in the first run only.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import _gpu
import pytest
import torch

HERE = Path(__file__).resolve().parent


def _job(out: Path, device: str, **env: str) -> dict[str, dict[str, torch.Tensor]]:
    full = {**os.environ, **env}
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_gpu.ROOT / "src"), full.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, str(HERE / "_stream_job.py"), str(out), device], env=full,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    result: dict[str, dict[str, torch.Tensor]] = torch.load(out)
    return result


@pytest.mark.parametrize("device", _gpu.CUDA_ONLY)
def test_async_copies_and_streams_match_blocking_launches(device: str, tmp_path: Path) -> None:
    asynchronous = _job(tmp_path / "async.pt", device)
    blocking = _job(tmp_path / "blocking.pt", device, CUDA_LAUNCH_BLOCKING="1")
    assert asynchronous.keys() == blocking.keys()
    for job in blocking:
        diff, name = _gpu.max_diff(asynchronous[job], blocking[job])
        assert diff == 0.0, f"{job}: {name} differs by {diff:.3g} between asynchronous and blocking launches"
