"""A small Trainer job for the elastic test: run by ``shardwise run`` (torchrun), or called inside a test rank.

``python _trainer_job.py CKPT_DIR OUT [KILL_AT]``: trains 10 steps at ZeRO
stage 2, saving every 2; with KILL_AT, rank 1 SIGKILLs itself at that step on
the first attempt (torchrun's ``TORCHELASTIC_RESTART_COUNT`` is 0).  Rank 0
writes the final full weights and loss to OUT.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _trainer_common import dataset, engine, full_weights  # noqa: E402

import shardwise  # noqa: E402
from shardwise.trainer import Callback, Trainer  # noqa: E402


class KillOnce(Callback):
    """SIGKILLs rank ``rank`` at ``step`` on the first attempt only: no cleanup, as a crash would be."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and trainer.rank == self.rank and metrics["step"] == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def train_job(checkpoint_dir: str, out: str, kill_at: Optional[int] = None) -> None:
    shardwise.init_distributed()
    e = engine(2)
    callbacks = [KillOnce(kill_at, rank=1)] if kill_at is not None else []
    summary = Trainer(e, dataset(40), max_steps=10, checkpoint_dir=checkpoint_dir, save_every=2, callbacks=callbacks,
                      progress=False, log_every=100).fit()
    weights = full_weights(e)
    if dist.get_rank() == 0:
        restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        torch.save({"weights": weights, "loss": summary.final_loss, "restarts": restarts}, out)
    e.destroy()


if __name__ == "__main__":
    # A worker stuck past a minute prints where it is and exits (the test then fails instead of hanging).
    faulthandler.dump_traceback_later(60, exit=True)
    train_job(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)
    dist.barrier()
    dist.destroy_process_group()
