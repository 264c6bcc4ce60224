"""The errors a rank raises when a collective cannot complete, each naming the ranks and operations."""

from __future__ import annotations

from typing import Optional

__all__ = ["CollectiveMismatchError", "CommError", "PeerFailedError", "RankGoneError", "StoreRecordError"]


class CommError(RuntimeError):
    """A collective could not complete; the message names every rank involved and what it was doing.

    ``where`` maps each rank of the process group (global ranks) to the operation it was in, as far as this rank
    could find out; ``gone`` lists the ranks that stopped (no heartbeat), ``failed`` the ranks that raised an error
    of their own (rank -> that error).  After a ``CommError`` the process group is unusable: exit
    (``shardwise run --max-restarts N`` then restarts the job).
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int = 0,
        where: Optional[dict[int, str]] = None,
        gone: Optional[list[int]] = None,
        failed: Optional[dict[int, str]] = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.where = dict(where or {})
        self.gone = list(gone or [])
        self.failed = dict(failed or {})


class RankGoneError(CommError):
    """A rank of the process group stopped (killed, crashed or exited) while the others needed it."""


class PeerFailedError(CommError):
    """Another rank raised an error of its own, so it will never join the collective this rank waits in."""


class CollectiveMismatchError(CommError):
    """The ranks issued different collectives (different modules, micro-batch counts, or calls)."""


class StoreRecordError(CommError):
    """A record in the job's c10d store that only shardwise's ranks write (a heartbeat, a fault note, a
    mismatch report) holds what none of them writes: another program wrote to the job's store."""
