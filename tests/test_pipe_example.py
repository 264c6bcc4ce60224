"""``examples/train_gpt_pipe.py``: the GPT defined once as layers, trained pipelined and as one module.

Both modes run in one 2-rank launch (the example's own functions, with its
argument parser), at the tiny size; each must bring the loss down.
"""

from __future__ import annotations

import sys
from pathlib import Path

from shardwise.testing import distributed_test

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@distributed_test(world_size=2, timeout=300)
def test_gpt_pipeline_and_sequential() -> None:
    sys.path.insert(0, str(EXAMPLES))
    import train_gpt_pipe as example
    from data import load_bytes
    from gpt import gpt_config

    common = ["--size", "tiny", "--steps", "6", "--log-every", "3", "--micro-batch", "4", "--data-bytes", "200000"]
    data = load_bytes(None, 200_000)
    cfg = gpt_config("tiny")
    first, last = example.train_pipelined(example.parse_args(["--stages", "2", *common]), cfg, data)
    assert last < first - 0.3, (first, last)
    first, last = example.train_sequential(example.parse_args(["--sequential", "--checkpoint-interval", "2", *common]), cfg, data)
    assert last < first - 0.3, (first, last)
