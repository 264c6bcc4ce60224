"""Reading config files: JSON as DeepSpeed reads it (comments, trailing commas), or YAML; total and bounded.

Whatever the bytes, reading ends in a mapping or a `ConfigError` naming the file and the fix, within about a second
(the bounds: `limits.py`; docs/from-deepspeed.md, "Limits").  YAML is PyYAML's safe loader with three departures, each
because the default silently does something else:

* a key given twice in one mapping is an error naming it (PyYAML keeps the last one);
* anchors and aliases are allowed (`engines: {a: &base {...}, b: *base}` is a fair use), but an alias is counted each
  time it is used, so a "billion laughs" file is refused in milliseconds, as is an alias that contains itself;
* `3e-4` and `1e6` are floats, as in YAML 1.2 and JSON (YAML 1.1 wants a dot, so PyYAML read them as strings).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import hjson  # type: ignore[import-untyped]
import yaml

from .errors import ConfigError
from .limits import MAX_DEPTH, MAX_FILE_BYTES, MAX_VALUES, MAX_YAML_LINES

__all__ = ["read_config_file"]


class _Refused(ValueError):
    """What a config may not hold (a duplicate key, a non-finite number, an alias bomb); not a syntax error."""


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


# The C parser when PyYAML was built with libyaml: ~3x faster on big (hostile) files.
_Base: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

# YAML 1.2's float, which also takes `3e-4` (no dot) and `1E6`; PyYAML's 1.1 forms (`.inf`, `1_000.5`) stay.
_FLOAT_12 = re.compile(r"^[-+]?(?:[0-9][0-9_]*)?(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


class _Loader(_Base):  # type: ignore[misc, valid-type]
    """Safe loading plus the three YAML rules of the module docstring."""

    has_anchors = True

    def construct_document(self, node: yaml.Node) -> Any:
        if self.has_anchors:  # without an anchor there is no alias: skip the walk (0.5 s on a 1 MiB file)
            _check_expansion(node)
        return super().construct_document(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> Any:
        _check_duplicates(self, node)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))


def _check_duplicates(loader: Any, node: yaml.MappingNode) -> None:
    """Refuse a key written twice in this mapping (keys merged in with `<<: *base` may be overridden)."""
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
            continue
        key = loader.construct_object(key_node)
        if key in seen:
            mark = key_node.start_mark
            raise _Refused(
                f"key `{str(key)[:80]}` appears twice in one mapping (line {mark.line + 1}); YAML would keep only "
                "the last one silently: keep one")
        seen.add(key)


def _check_expansion(root: yaml.Node) -> None:
    """Count the values `root` expands to, each alias as often as it is used; refuse past MAX_VALUES.

    Memoised per node, so the cost is linear in the nodes written, not in the expansion. Iterative: a
    deeply nested document cannot hit the recursion limit here.
    """
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        children = _children(node)
        if children_done:
            open_nodes.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in children)
            if sizes[id(node)] > MAX_VALUES:
                raise _Refused(_bomb(node, sizes[id(node)]))
            continue
        if id(node) in open_nodes:
            raise _Refused(f"an alias at line {node.start_mark.line + 1} contains itself, so the document "
                                  "is infinite; write the values out")
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in sizes)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _bomb(node: yaml.Node, size: int) -> str:
    return (f"the YAML from line {node.start_mark.line + 1} expands to more than {MAX_VALUES} values through "
            f"anchors and aliases (at least {size}; each alias counts each time it is used, and a real config "
            "holds a few hundred): write the values out, or use fewer aliases")


def load_yaml(text: str) -> Any:
    """Parse one YAML document under the rules of the module docstring (errors: yaml.YAMLError, _Refused)."""
    lines = text.count("\n") + text.count(",")
    if lines > MAX_YAML_LINES:
        raise _Refused(
            f"the YAML has {lines} lines and commas; a config has a few hundred, and shardwise reads at most "
            f"{MAX_YAML_LINES} (YAML parses at ~100k values a second): check that it is the config file, or write "
            "it as JSON")
    if _maybe_deep(text):
        _check_depth(text)
    loader = _Loader(text)
    loader.has_anchors = "&" in text
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _maybe_deep(text: str) -> bool:
    """Whether `text` might nest deeper than MAX_DEPTH, from a bound that costs two C passes.

    Block nesting needs one more column of indentation or `- ` per level, flow nesting one bracket:
    with at most 8 brackets and no line led by 24 such characters, the depth is at most 8 + 24.
    """
    brackets = text.count("[") + text.count("{")
    return brackets > 8 or re.search(r"^[ ?:-]{24,}", text, re.MULTILINE) is not None


def _check_depth(text: str) -> None:
    """Refuse nesting deeper than MAX_DEPTH before composing: libyaml's C composer recurses on the C
    stack and crashes the process at ~100k levels (measured), where Python would raise RecursionError."""
    depth = 0
    try:
        for event in yaml.parse(text, Loader=_Base):
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_DEPTH:
                    raise _too_deep(event.start_mark)
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
    except yaml.MarkedYAMLError as exc:
        # libyaml 0.2.5+ refuses past its own limit (1000 levels) while scanning ahead of the events counted here
        if "maximum nesting depth" not in str(exc.problem):
            raise
        raise _too_deep(exc.problem_mark) from None


def _too_deep(mark: Any) -> _Refused:
    line = mark.line + 1 if mark is not None else "?"
    return _Refused(f"the YAML nests deeper than {MAX_DEPTH} levels at line {line} (a config nests about "
                           "5); remove the extra nesting")


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
        raise ConfigError(f"config file `{path}`: unsupported suffix {suffix!r}; expected `.json`, `.yaml` or `.yml`")
    if not path.is_file():
        raise ConfigError(f"config file `{path}` does not exist; check the path")
    text = _read_text(path)
    kind = "JSON" if suffix == ".json" else "YAML"
    try:
        data = _parse_json(text) if suffix == ".json" else load_yaml(text)
    except RecursionError:
        raise ConfigError(f"config file `{path}` nests too deep to read (a config nests about 5 levels); remove "
                          "the extra nesting") from None
    except (ValueError, TypeError, yaml.YAMLError) as exc:
        # ValueError covers _Refused, hjson's and json's errors and int() digit limits;
        # TypeError an unhashable YAML key such as `[a]: 1`.
        what = "is refused" if isinstance(exc, _Refused) else f"is not valid {kind}"
        raise ConfigError(f"config file `{path}` {what}: {str(exc)[:500]}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file `{path}`: top level is {type(data).__name__}; expected a mapping of config keys")
    return data
