"""Shared pieces of the fault tests: configs with short timeouts, a way to die, and the fault-table log.

Every fault test that measures something records one row with :func:`record_row`;
``python -m benchmarks.fault_table`` turns the rows into ``docs/faults.md``'s table
(no figure in that table is written by hand).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch.distributed as dist
from _parity import adamw, batch, make_model

import shardwise
from shardwise.faults import CommError

#: seconds any collective may wait in the fault tests (production default: 300)
COMMS_TIMEOUT = 3.0
#: the rank that dies, stops or disagrees in the two-rank fault tests
VICTIM = 1
#: where rows of the fault table go (set by the generator; tests run without it too)
TABLE_ENV = "SHARDWISE_FAULT_TABLE"


def fault_config(stage: int, **extra: Any) -> dict[str, Any]:
    """A small two-rank config whose collectives give up after `COMMS_TIMEOUT` seconds."""
    config: dict[str, Any] = {
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "comms": {"timeout": COMMS_TIMEOUT},
        "checkpoint": {"timeout": COMMS_TIMEOUT},
    }
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


def make_engine(stage: int, seed: int = 0, **extra: Any) -> Any:
    model = make_model(seed)
    return shardwise.initialize(model, adamw(model.parameters()), fault_config(stage, **extra))


def train_step(engine: Any, step: int) -> float:
    loss = engine(*batch(step, dist.get_rank()))
    engine.backward(loss)
    engine.step()
    return float(loss.item())


def die() -> None:
    """End this rank at once, as the OOM killer or a node failure would (no cleanup, no message)."""
    os.kill(os.getpid(), signal.SIGKILL)


def outcome(action: Callable[[], Any]) -> dict[str, Any]:
    """Run ``action`` and describe how it ended: the error type, its message and facts, the seconds it took."""
    start = time.monotonic()
    try:
        action()
    except CommError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start,
                "gone": exc.gone, "failed": sorted(exc.failed), "where": exc.where}
    except Exception as exc:  # noqa: BLE001 - reported, the test decides
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def bounded_outcome(action: Callable[[], Any], limit: float) -> dict[str, Any]:
    """:func:`outcome`, given up after ``limit`` seconds: a wait that never ends becomes a result
    (``error`` "still waiting") the test can assert on, instead of a hang until the launch timeout.

    The action runs in a daemon thread; one still waiting is left behind (the rank should then
    return at once: the process's exit ends the thread)."""
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(outcome(action)), daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        return {"error": "still waiting", "seconds": limit}
    return result


def record_row(table: str, fault: str, stage: Optional[str], result: str, seconds: Optional[float]) -> None:
    """Add one row of the fault table (only when the generator asked for rows)."""
    path = os.environ.get(TABLE_ENV)
    if not path:
        return
    row = {"table": table, "fault": fault, "stage": stage, "result": result,
           "seconds": None if seconds is None else round(seconds, 2)}
    with Path(path).open("a") as handle:
        handle.write(json.dumps(row) + "\n")
