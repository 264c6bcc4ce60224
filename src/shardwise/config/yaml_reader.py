"""YAML for configs: PyYAML's safe loader, with duplicate keys refused, aliases bounded and `3e-4` a number.

Three departures from `yaml.safe_load`, each because the default silently does something else:

* a key given twice in one mapping is an error naming it (PyYAML keeps the last one);
* anchors and aliases are allowed (`engines: {a: &base {...}, b: *base}` is a fair use), but the document
  they expand to may hold at most `limits.MAX_VALUES` values: an alias is counted each time it is used,
  so a "billion laughs" file (ten aliases of ten aliases of ...) is refused in milliseconds, as is an
  alias that contains itself;
* `3e-4` and `1e6` are floats, as in YAML 1.2 and JSON (YAML 1.1 wants a dot, so PyYAML read them as
  strings).
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from .limits import MAX_DEPTH, MAX_VALUES, MAX_YAML_LINES

__all__ = ["ConfigYAMLError", "load_yaml"]

# The C parser when PyYAML was built with libyaml: ~3x faster on big (hostile) files.
_Base: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

# YAML 1.2's float, which also takes `3e-4` (no dot) and `1E6`; PyYAML's 1.1 forms (`.inf`, `1_000.5`) stay.
_FLOAT_12 = re.compile(r"^[-+]?(?:[0-9][0-9_]*)?(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


class ConfigYAMLError(ValueError):
    """A YAML document a config may not be (duplicate key, alias bomb); the message names the fix."""


class _Loader(_Base):  # type: ignore[misc, valid-type]
    """Safe loading plus the three rules of the module docstring."""

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
            raise ConfigYAMLError(
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
                raise ConfigYAMLError(_bomb(node, sizes[id(node)]))
            continue
        if id(node) in open_nodes:
            raise ConfigYAMLError(f"an alias at line {node.start_mark.line + 1} contains itself, so the document "
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
    """Parse one YAML document under the rules above (errors: yaml.YAMLError, ConfigYAMLError)."""
    lines = text.count("\n") + text.count(",")
    if lines > MAX_YAML_LINES:
        raise ConfigYAMLError(
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


def _too_deep(mark: Any) -> ConfigYAMLError:
    line = mark.line + 1 if mark is not None else "?"
    return ConfigYAMLError(f"the YAML nests deeper than {MAX_DEPTH} levels at line {line} (a config nests about "
                           "5); remove the extra nesting")
