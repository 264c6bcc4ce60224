"""Reading config files: JSON as DeepSpeed reads it (comments, trailing commas), or YAML; total and bounded.

Whatever the bytes, reading ends in a mapping or a `ConfigError` naming the file and the fix: a file over
`limits.MAX_FILE_BYTES`, bytes that are not UTF-8, a syntax error, a key given twice, `1e999`, `NaN`,
nesting past `limits.MAX_DEPTH` and YAML aliases that expand past `limits.MAX_VALUES` are all errors
(see `yaml_reader.py` for YAML's rules). No file takes more than about a second to refuse.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import hjson  # type: ignore[import-untyped]
import yaml

from .errors import ConfigError
from .limits import MAX_FILE_BYTES
from .yaml_reader import ConfigYAMLError, load_yaml

__all__ = ["read_config_file"]


class _Refused(ValueError):
    """A JSON value a config may not hold (a duplicate key, a non-finite number); not a syntax error."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict; a key given twice is an error, as in DeepSpeed."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Refused(f"key `{str(key)[:80]}` appears twice in one object; keep one")
        out[key] = value
    return out


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"the number {text[:40]} does not fit a float (it reads as infinity); write a finite value")
    return value


def _constant(name: str) -> float:
    raise _Refused(f"`{name}` is not a finite number; write a finite value")


def _parse_json(text: str) -> Any:
    """Strict JSON first (C speed); on a syntax error, hjson as DeepSpeed reads it (`//`, `#`, trailing commas)."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_float=_finite, parse_constant=_constant)
    except _Refused:
        raise
    except json.JSONDecodeError:
        pass
    try:
        return hjson.loads(text, object_pairs_hook=_no_duplicates)
    except OverflowError:  # hjson turns `1e999` into inf, then fails converting it to an int
        raise _Refused("a number does not fit a float (it reads as infinity, like `1e999`); write a finite "
                       "value") from None


def _parse(text: str, suffix: str) -> Any:
    return _parse_json(text) if suffix == ".json" else load_yaml(text)


def _read_text(path: Path) -> str:
    """The file as text, refusing one over MAX_FILE_BYTES before reading it whole, or one that is not UTF-8."""
    with path.open("rb") as handle:
        data = handle.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(
            f"config file `{path}` is larger than {MAX_FILE_BYTES // 1024 // 1024} MiB (a config is a few KB); "
            "check that it is the config file, or split out what is not config")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file `{path}` is not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start}); save it as "
            "UTF-8") from None


def read_config_file(path: Path) -> dict[str, Any]:
    """Parse a .json/.yaml/.yml file whose top level must be a mapping."""
    suffix = path.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise ConfigError(
            f"config file `{path}`: unsupported suffix {suffix!r}; expected `.json`, `.yaml` or `.yml`")
    if not path.is_file():
        raise ConfigError(f"config file `{path}` does not exist; check the path")
    text = _read_text(path)
    kind = "JSON" if suffix == ".json" else "YAML"
    try:
        data = _parse(text, suffix)
    except RecursionError:
        raise ConfigError(f"config file `{path}` nests too deep to read (a config nests about 5 levels); remove "
                          "the extra nesting") from None
    except (ValueError, TypeError, yaml.YAMLError) as exc:
        # ValueError covers _Refused, ConfigYAMLError, hjson's and json's errors and int() digit limits;
        # TypeError an unhashable YAML key such as `[a]: 1`.
        what = "is refused" if isinstance(exc, (_Refused, ConfigYAMLError)) else f"is not valid {kind}"
        raise ConfigError(f"config file `{path}` {what}: {str(exc)[:500]}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file `{path}`: top level is {type(data).__name__}; expected a mapping of config keys")
    return data
