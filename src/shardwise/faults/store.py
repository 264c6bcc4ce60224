"""Which process hosts the c10d store, so that a store that cannot be reached names its lost host.

Every liveness record goes through the c10d store.  When the process that
hosts it dies, the store dies with it, and every read of a record fails: the
peers' records are not missing, they are unreachable.  With ``env://`` or
``tcp://`` rendezvous (``init_process_group`` outside torchrun, or
``shardwise.init_distributed`` under a launcher that does not host the store)
rank 0 creates the ``TCPStore`` server in its own process; torchrun's agent
hosts it instead when it sets ``TORCHELASTIC_USE_AGENT_STORE=True`` (a rank's
death then leaves the store up).  A file store has no host.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

__all__ = ["StoreHost", "store_host"]


@dataclass(frozen=True)
class StoreHost:
    """Where a store lives: its address, and the global rank whose process serves it (None: no rank's)."""

    address: str
    rank: Optional[int]

    def describe(self) -> str:
        """The store and its host, in words."""
        if self.rank is not None:
            return f"the c10d store at {self.address} (hosted by rank {self.rank})"
        return f"the c10d store at {self.address} (hosted by torchrun's agent, or the process that created it)"


def _innermost(store: Any) -> Any:
    """The store under any prefix stores."""
    seen = 0
    while hasattr(store, "underlying_store") and seen < 16:
        store, seen = store.underlying_store, seen + 1
    return store


def store_host(store: Any) -> Optional[StoreHost]:
    """Who hosts ``store`` (None for a store without a server, such as a file store)."""
    base = _innermost(store)
    if not isinstance(base, dist.TCPStore):
        return None
    address = f"{base.host}:{base.port}"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return StoreHost(address, None)
    return StoreHost(address, 0)  # env:// and tcp:// rendezvous: rank 0 serves it (`is_master`)
