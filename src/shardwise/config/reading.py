"""Reading config files: JSON as DeepSpeed reads it (comments, trailing commas), or YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hjson  # type: ignore[import-untyped]
import yaml

from .errors import ConfigError

__all__ = ["read_config_file"]


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict; a key given twice is an error, as in DeepSpeed."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key `{key}` appears twice in one object; keep one")
        out[key] = value
    return out


def _parse(text: str, suffix: str) -> Any:
    if suffix == ".json":
        # DeepSpeed reads its JSON with hjson: `//` and `#` comments and trailing commas are fine.
        return hjson.loads(text, object_pairs_hook=_no_duplicates)
    return yaml.safe_load(text)


def read_config_file(path: Path) -> dict[str, Any]:
    """Parse a .json/.yaml/.yml file whose top level must be a mapping."""
    suffix = path.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise ConfigError(
            f"config file `{path}`: unsupported suffix {suffix!r}; expected `.json`, `.yaml` or `.yml`")
    if not path.is_file():
        raise ConfigError(f"config file `{path}` does not exist; check the path")
    text = path.read_text(encoding="utf-8")
    try:
        data = _parse(text, suffix)
    except (ValueError, yaml.YAMLError) as exc:
        kind = "JSON" if suffix == ".json" else "YAML"
        raise ConfigError(f"config file `{path}` is not valid {kind}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file `{path}`: top level is {type(data).__name__}; expected a mapping of config keys")
    return data
