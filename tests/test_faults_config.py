"""Hostile and malformed config files: each is `shardwise config validate` exit 2 with a named error, fast.

Each case writes a file, runs the CLI in this process, and checks the exit status, that stderr names
the problem, that the output is small, and the time to error. The files are what a tester (or a
corrupted disk) produces: an alias bomb, 100k-deep nesting, 200k unknown keys, bytes that are not
UTF-8, `1e999`, `.inf` where a timeout belongs, booleans where a number belongs, duplicate keys.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from _faults_common import record_row

from shardwise.cli.commands import main

#: seconds a hostile file may take to refuse, in process (the slowest measures ~0.6 s on a loaded 2-core host)
LIMIT_S = 2.0
#: bytes of stderr at most: 20 problem lines of at most ~400 characters, and the header
MAX_ERR = 10_000


def _bomb() -> str:
    """A "billion laughs" inside `optimizer.params`: nine levels of ten aliases, 10^9 values."""
    levels = ["    l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    levels += [f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 10)]
    return "optimizer:\n  type: Adam\n  params:\n" + "\n".join(levels) + "\n"


def _unknown_keys() -> str:
    return "{" + ",".join(f'"k{i:x}": 1' for i in range(200_000)) + "}"


# fault -> (file name, contents, what stderr must say)
CASES: dict[str, tuple[str, Callable[[], str | bytes], str]] = {
    "YAML alias bomb (10^9 values) in `optimizer.params`": (
        "bomb.yaml", _bomb, "expands to more than 500000 values through anchors and aliases"),
    "YAML alias that contains itself": ("cycle.yaml", lambda: "a: &x\n  - *x\n", "contains itself"),
    "200k unknown keys": ("keys.json", _unknown_keys, "... and 199980 more"),
    "JSON nested 100k deep": ("deep.json", lambda: '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}",
                              "nests too deep to read"),
    "YAML nested 100k deep (crashes libyaml's composer)": (
        "deep.yaml", lambda: "a: " + "[" * 100_000 + "]" * 100_000 + "\n", "nests deeper than 32 levels"),
    "bytes that are not UTF-8": ("latin.json", lambda: b'{"gradient_clipping": 1.0, "\xe9": 1}',
                                 "is not UTF-8 text (byte 0xe9 at offset 28)"),
    "`1e999` (JSON)": ("inf.json", lambda: '{"train_batch_size": 1e999}', "does not fit a float"),
    "`NaN` (JSON)": ("nan.json", lambda: '{"gradient_clipping": NaN}', "`NaN` is not a finite number"),
    "`comms.timeout: .inf` (YAML)": ("timeout.yaml", lambda: "comms: {timeout: .inf}\n",
                                     "`comms.timeout`: got inf; expected a finite number"),
    "`lr: .inf` (YAML)": ("lr.yaml", lambda: "optimizer: {type: AdamW, params: {lr: .inf}}\n",
                          "`optimizer.params.lr`: got inf"),
    "`stage: true`": ("bool.yaml", lambda: "zero_optimization: {stage: true}\n",
                      "`true` is a boolean, not a number"),
    "`train_micro_batch_size_per_gpu: true`": (
        "micro.json", lambda: '{"train_micro_batch_size_per_gpu": true}', "`true` is a boolean, not a number"),
    "duplicate YAML key": ("dup.yaml", lambda: "train_batch_size: 8\ntrain_batch_size: 16\n",
                           "key `train_batch_size` appears twice in one mapping (line 2)"),
    "duplicate key in hjson (comments, trailing comma)": (
        "dup.json", lambda: '{// c\n "zero_optimization": {"stage": 1, "stage": 2,},}',
        "key `stage` appears twice in one object"),
    "1e21 accumulation steps": ("gas.yaml", lambda: "gradient_accumulation_steps: 1e21\n",
                                "`gradient_accumulation_steps`: got 1e+21; expected an integer in 1..1048576"),
    "a file over 4 MiB": ("big.json", lambda: "{}" + " " * (4 * 1024 * 1024), "is larger than 4 MiB"),
    "a 1 MB key": ("key.yaml", lambda: "k" * 1_000_000 + ": 1\n", "is not valid YAML"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_config_file_is_a_config_error(case: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    name, contents, expected = CASES[case]
    text = contents()
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    start = time.perf_counter()
    code = main(["config", "validate", str(path)])
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err
    assert code == 2, err[:2000]
    assert expected in err, err[:2000]
    assert len(err) < MAX_ERR, f"{len(err)} bytes of error output"
    assert seconds < LIMIT_S, f"{seconds:.2f} s to refuse"
    record_row("misuse", f"config file: {case}", "-",
               "`ConfigError` naming the key or line and the fix; `config validate` exits 2", seconds)
