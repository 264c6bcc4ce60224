"""Whether a process still runs: how the sweeps of shared-memory files and offload folders judge their creators."""

from __future__ import annotations

import os

__all__ = ["running"]


def running(pid: int) -> bool:
    """Whether process ``pid`` exists (on this host, in this pid namespace)."""
    try:
        os.kill(pid, 0)  # signal 0: the checks only, nothing is sent
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists, owned by someone else
    return True
