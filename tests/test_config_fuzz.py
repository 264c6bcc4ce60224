"""Fuzzing the config reader: thousands of generated configs, each accepted or a ConfigError, each fast.

A seeded generator (reproducible: a failure names its seed) mutates the real configs under
tests/configs/ and examples/configs/: values replaced by hostile ones (booleans, text, inf, NaN, huge
numbers, nested junk), keys added, dropped and misspelled; and, as text, JSON and YAML files cut short,
with bytes changed, lines repeated and anchors or aliases spliced in. Whatever comes out must be a
`Config` (that survives `batch_sizes`, `resolve` and a round trip through `to_dict`) or a `ConfigError`;
any other exception, or a case slower than a second, fails the test.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardwise.config import Config, ConfigError, read_config_file
from shardwise.config.catalog import CATALOG

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(p for p in (ROOT / "tests" / "configs").rglob("*") if p.is_file()),
                  *(ROOT / "examples" / "configs").glob("*.yaml")])
CASE_LIMIT_S = 1.0

_VALUES: list[Any] = [
    True, False, None, 0, 1, -1, 2, 3, 7, 2**70, -(2**70), 1e21, 1.5, 0.0, 1e-300, float("inf"), float("-inf"),
    float("nan"), "2", "1e-3", "5e8", "1e999", "true", "false", "auto", "none", "cpu", "nvme", "", "x" * 500, [],
    [0.9, 0.999], [1, "a", None], {}, {"enabled": True}, {"enabled": False}, {"device": "cpu"},
    {"a": {"b": {"c": 1}}}, "Adam", "WarmupLR", "sum", "mean",
]
_KEYS = sorted({*(p.rsplit(".", 1)[-1] for p in CATALOG), *Config.model_fields, "stage", "enabled", "type",
                "params", "lr", "betas", "device", "timeout", "total_num_steps", "warmup_num_steps", "zzz"})


def _slots(node: Any) -> list[tuple[Any, Any]]:
    """Every (container, key) pair under `node`, the root's own included."""
    out: list[tuple[Any, Any]] = []
    stack = [node]
    while stack:
        here = stack.pop()
        pairs = here.items() if isinstance(here, dict) else enumerate(here) if isinstance(here, list) else ()
        for key, value in pairs:
            out.append((here, key))
            stack.append(value)
    return out


def _mappings(node: Any) -> list[dict[str, Any]]:
    found = [node] if isinstance(node, dict) else []
    return found + [c[k] for c, k in _slots(node) if isinstance(c[k], dict)]


def _replace(rng: random.Random, data: dict[str, Any]) -> None:
    slots = _slots(data)
    if slots:
        container, key = rng.choice(slots)
        container[key] = copy.deepcopy(rng.choice(_VALUES))


def _add(rng: random.Random, data: dict[str, Any]) -> None:
    rng.choice(_mappings(data))[rng.choice(_KEYS)] = copy.deepcopy(rng.choice(_VALUES))


def _drop_or_misspell(rng: random.Random, data: dict[str, Any]) -> None:
    slots = [(c, k) for c, k in _slots(data) if isinstance(c, dict)]
    if not slots:
        return
    container, key = rng.choice(slots)
    value = container.pop(key)
    if rng.random() < 0.5 and key:
        cut = rng.randrange(len(key))
        container[key[:cut] + key[cut + 1:]] = value


_MUTATIONS: list[Callable[[random.Random, dict[str, Any]], None]] = [_replace, _add, _drop_or_misspell]


def _mutated(rng: random.Random, base: dict[str, Any]) -> dict[str, Any]:
    data = copy.deepcopy(base)
    for _ in range(rng.randint(1, 4)):
        rng.choice(_MUTATIONS)(rng, data)
    return data


_SPLICES = ["&a ", "*a", "<<: *a\n", "[", "]", "{", "}", ",", ": ", "\n- ", "\t", "\\u0000", '"', "#", "//",
            "\xff", "1e999", "NaN", ".inf", "true", "- - - -", "\n  \n"]


_NUMBER = re.compile(r"(?<![\w.])-?\d+(\.\d+)?([eE][-+]?\d+)?(?![\w.])")
_TOKENS = ["1e999", "-1e999", "NaN", "Infinity", ".inf", ".nan", "true", "'2'", "1e21", "2.5", "0"]


def _number_swapped(rng: random.Random, text: str) -> str:
    """`text` with one number literal replaced by a hostile token (`1e999`, `NaN`, `true`, ...)."""
    numbers = list(_NUMBER.finditer(text))
    if not numbers:
        return text
    match = rng.choice(numbers)
    return text[:match.start()] + rng.choice(_TOKENS) + text[match.end():]


def _text_mutated(rng: random.Random, text: str) -> str:
    if rng.random() < 0.5:
        return _number_swapped(rng, text)
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(len(text) + 1)
        choice = rng.random()
        if choice < 0.2:
            text = text[:at]
        elif choice < 0.4:
            line = text.splitlines(keepends=True)
            if line:
                i = rng.randrange(len(line))
                text = "".join(line[:i + 1] + line[i:])
        elif choice < 0.5 and text:
            text = text[:at] + text[at + 1:]
        else:
            text = text[:at] + rng.choice(_SPLICES) + text[at:]
    return text


def _leaves(node: Any, path: tuple[str, ...] = ()) -> dict[str, Any]:
    """Dotted path -> value for every scalar under `node`."""
    if isinstance(node, dict):
        return {k: v for key, value in node.items() for k, v in _leaves(value, (*path, str(key))).items()}
    if isinstance(node, list):
        return {k: v for i, value in enumerate(node) for k, v in _leaves(value, (*path, str(i))).items()}
    return {".".join(path): node}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_accepted(config: Config, raw: dict[str, Any] | None) -> None:
    """The rules hold for what was accepted, and what a caller does next must not fail another way."""
    settled = _leaves(config.model_dump())
    assert all(math.isfinite(v) for v in settled.values() if _is_number(v)), "every number is finite"
    noted = {note.path for note in config.notes}
    for path, value in _leaves(raw or {}).items():
        if _is_number(settled.get(path)):
            assert not isinstance(value, bool), f"`{path}: {value}` became the number {settled[path]}"
            text = isinstance(value, str) and value.strip().lower() != "auto"  # `auto` has its own rules
            said = any(path == n or path.startswith(n + ".") for n in noted)  # a list gets one line
            assert not text or said, f"`{path}: {value!r}` became a number silently"
    again = Config.load(config.to_dict())
    assert again == config, (config.to_dict(), again.to_dict())
    for step in (lambda: config.batch_sizes(2), lambda: config.resolve(world_size=2, total_num_steps=100)):
        try:
            step()
        except ConfigError:
            pass


def _outcome(load: Callable[[], Config], raw: dict[str, Any] | None = None) -> str:
    start = time.perf_counter()
    try:
        _check_accepted(load(), raw)
        result = "accepted"
    except ConfigError as error:
        assert len(str(error)) < 12_000, "the message is bounded"
        result = "refused"
    seconds = time.perf_counter() - start
    assert seconds < CASE_LIMIT_S, f"{seconds:.2f} s"
    return result


def _bases() -> list[tuple[str, dict[str, Any]]]:
    return [(path.suffix, read_config_file(path)) for path in SOURCES]


@pytest.mark.parametrize("seed", range(4))
def test_generated_dicts_are_accepted_or_config_errors(seed: int) -> None:
    rng = random.Random(seed)
    bases = _bases()
    results = {"accepted": 0, "refused": 0}
    for case in range(750):
        _, base = rng.choice(bases)
        data = _mutated(rng, base)
        try:
            results[_outcome(functools.partial(Config.load, data), copy.deepcopy(data))] += 1
        except AssertionError as failure:
            raise AssertionError(f"seed {seed} case {case}: {json.dumps(data, default=str)[:2000]}") from failure
    assert min(results.values()) > 50, results  # the generator reaches both sides


@pytest.mark.parametrize("seed", range(2))
def test_generated_files_are_accepted_or_config_errors(seed: int, tmp_path: Path) -> None:
    rng = random.Random(1000 + seed)
    bases = _bases()
    results = {"accepted": 0, "refused": 0}
    for case in range(600):
        _, base = rng.choice(bases)
        suffix = rng.choice([".json", ".yaml"])
        data = _mutated(rng, base) if rng.random() < 0.4 else base
        text = json.dumps(data) if suffix == ".json" else yaml.safe_dump(data)
        path = tmp_path / f"case{suffix}"
        text = _text_mutated(rng, text) if rng.random() < 0.6 else text
        path.write_text(text, encoding="utf-8", errors="surrogateescape")
        try:
            results[_outcome(functools.partial(Config.load, path))] += 1
        except AssertionError as failure:
            raise AssertionError(f"seed {seed} case {case}: {path.read_bytes()[:2000]!r}") from failure
    assert min(results.values()) > 30, results
