"""A third process that writes into a job's c10d store, as any program that can reach its port could.

    python tests/_store_forger.py PORT '{"key": "value", ...}'

The job must rendezvous through a ``TCPStore`` (``env://``: rank 0 hosts it on
``MASTER_PORT``).  Keys are the store's own (with the process group's prefix,
see :func:`store_prefix`).  Used by ``test_faults_store_values.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["forge", "store_prefix"]


def store_prefix() -> str:
    """(in a rank) The prefix the default process group's store puts before every key shardwise writes."""
    store: Any = dist.distributed_c10d._get_default_store()
    probe = f"forger-probe-{dist.get_rank()}"
    store.set(probe, "1")
    keys = store._underlying_non_prefix_store.list_keys()
    return next(k for k in keys if k.endswith(probe))[: -len(probe)]


def forge(port: int, values: dict[str, str]) -> None:
    """Write ``values`` (full keys) into the store on ``port`` from a separate process, and wait for it."""
    subprocess.run([sys.executable, __file__, str(port), json.dumps(values)], check=True, timeout=60)


def main() -> None:
    port, values = int(sys.argv[1]), json.loads(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
    for key, value in values.items():
        store.set(key, value)


if __name__ == "__main__":
    main()
