"""One rule for every key: turn a raw DeepSpeed-style dict into what the section models validate.

`prepare` walks the raw config along the section models and applies to each key the rule of docs/from-deepspeed.md
("One rule for every config key", "Names and values"): aliases read as their canonical name, `auto` settled by
`auto.py`, string numbers read as numbers, a `catalog.CATALOG` key accepted or refused by its entry, anything else an
unknown key with the closest known one. Problems are collected, so the user sees all of them at once (past
`errors.MAX_SHOWN`, unknown keys are counted without the difflib search).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from .auto import BATCH_KEYS, resolves_later
from .catalog import ALIASES, CATALOG, OFFLOAD_KEYS, Entry, is_auto
from .errors import MAX_SHOWN, Note, problem_line, shown_value, suggest
from .limits import NO_LIMIT
from .sections import OffloadSection, OptimizerConfig, SchedulerConfig, field_default, section_of, upper_bound

__all__ = ["Prepared", "coerce", "prepare"]

_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_INTEGER = re.compile(r"[+-]?\d+")


def coerce(value: Any) -> Any:
    """Read a string number or boolean as DeepSpeed's JSON would have it: `"5e8"` -> 5e8, `"true"` -> True.

    YAML reads `3e-4` (no dot) as a string, and hand-written JSON quotes numbers now and then;
    every key is read the same way. Other values (lists element-wise) are returned as they are.
    """
    if isinstance(value, list):
        return [coerce(v) for v in value]
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if _INTEGER.fullmatch(text) and len(text) < 100:  # int() raises past 4300 digits; longer stays text
        return int(text)
    if _NUMBER.fullmatch(text) and math.isfinite(number := float(text)):
        return number
    # `"1e999"` stays a string (and a number field refuses it) rather than becoming inf
    return value


def prepare(raw: Any, root: type[BaseModel], prefix: tuple[str, ...] = ()) -> Prepared:
    """Apply the policy to `raw` (a config dict; anything else is left for pydantic to reject)."""
    prepared = Prepared(prefix)
    prepared.data = prepared.section(root, raw, ()) if isinstance(raw, Mapping) else raw
    return prepared


#: per offload section, the keys that act when its device is nvme (the others tune DeepSpeed's own swapping)
_NVME_ACTING = {"offload_optimizer": frozenset({"nvme_path", "buffer_count", "pin_memory", "ratio"}),
                "offload_param": frozenset({"nvme_path", "buffer_count", "pin_memory", "max_in_cpu"})}
#: ... and when it is cpu (on a job on an accelerator; `resolve` says what a CPU job makes of them)
_CPU_ACTING = {"offload_optimizer": frozenset({"pin_memory", "ratio"}),
               "offload_param": frozenset({"pin_memory", "buffer_count"})}


class Prepared:
    """The outcome of `prepare`, made by walking the raw config: data for pydantic, info lines, problems, and
    `auto`s left for `resolve`."""

    def __init__(self, prefix: tuple[str, ...]) -> None:
        self.prefix = prefix
        self.data: Any = None
        self.notes: list[Note] = []
        self.problems: list[str] = []
        #: dotted path -> how its `auto` resolves at initialize
        self.pending: dict[str, str] = {}

    def shown(self, path: tuple[str, ...]) -> str:
        """The path as the user reads it (with an `engines.NAME.` prefix in a named-config file)."""
        return ".".join(self.prefix + path)

    def section(self, model: type[BaseModel], raw: Mapping[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        fields = model.model_fields  # a property that costs a microsecond: read once, not per key
        for key, value in self._renamed(raw, path).items():
            here = (*path, key)
            if key in fields:
                self._field(model, key, value, here, out)
            elif ".".join(here) in CATALOG:
                self._judge(CATALOG[".".join(here)], value, here)
            else:
                self._unknown(model, here)
        return out

    def _renamed(self, raw: Mapping[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
        """`raw` with DeepSpeed's aliases read as their canonical names."""
        aliases = ALIASES.get(".".join(path), {})
        out: dict[str, Any] = {}
        for key, value in raw.items():
            key = str(key)
            alias = aliases.get(key)
            if alias is None:
                out[key] = value
                continue
            canonical = alias.name
            if canonical in raw or canonical in out:
                self.problems.append(
                    f"`{self.shown((*path, key))}` and `{self.shown((*path, canonical))}` are the same setting "
                    f"(`{key}` is DeepSpeed's other name for it); keep only `{canonical}`")
                continue
            out[canonical] = alias.convert(value) if alias.convert is not None else value
            self.notes.append(Note(self.shown((*path, key)),
                                   f"`{self.shown((*path, key))}` is read as `{self.shown((*path, canonical))}`"))
        return out

    def _field(self, model: type[BaseModel], key: str, value: Any, here: tuple[str, ...], out: dict[str, Any]) -> None:
        dotted = ".".join(here)
        if is_auto(value):
            self._auto(model, key, here)
            return
        annotation = model.model_fields[key].annotation
        sub = section_of(annotation)
        if dotted == "zero_optimization" and isinstance(value, bool):
            # DeepSpeed's oldest format: `zero_optimization: true` was stage 1.
            out[key] = {"stage": int(value)}
            shown = self.shown(here)
            read = f"`{shown}: {str(value).lower()}` is read as `{shown}.stage: {int(value)}` (DeepSpeed's legacy form)"
            self.notes.append(Note(shown, read))
        elif sub is not None and issubclass(sub, OffloadSection):
            offload = self._offload(value, here)
            if offload is not None:
                out[key] = offload
        elif sub is not None and isinstance(value, Mapping):
            out[key] = self.section(sub, value, here)
        elif key == "params" and model in (OptimizerConfig, SchedulerConfig) and isinstance(value, Mapping):
            out[key] = self._params(value, here)
        elif annotation in (str, str | None) or dotted.endswith(".type"):
            out[key] = value
        else:
            out[key] = self._coerced(value, here)
            if dotted in NO_LIMIT:
                out[key] = self._clamped(model, key, out[key], here)

    def _clamped(self, model: type[BaseModel], key: str, value: Any, here: tuple[str, ...]) -> Any:
        """A number past the field's bound, where that already means "no limit", read as the bound."""
        bound = upper_bound(model, key)
        if bound is None or isinstance(value, bool) or not isinstance(value, (int, float)) or not value > bound:
            return value
        shown = self.shown(here)
        written = f"{value:g}" if isinstance(value, float) else f"{value:,}"
        self.notes.append(Note(shown, f"`{shown}: {written}` is past {bound:,}, where it already means no limit "
                                      f"here: read as {bound:,}"))
        return bound

    def _coerced(self, value: Any, here: tuple[str, ...]) -> Any:
        """`value` with a string number or boolean read as one, and an info line when that happened."""
        read = coerce(value)
        if read != value or type(read) is not type(value):
            shown = self.shown(here)
            written = shown_value(value)
            self.notes.append(Note(shown, f"`{shown}: {written}` is text; read as {shown_value(read)} "
                                          "(write it without quotes to silence this line)"))
        return read

    def _params(self, raw: Mapping[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in raw.items():
            here = (*path, str(key))
            if is_auto(value):
                self.pending[".".join(here)] = resolves_later(".".join(here)) or "the default"
            else:
                out[str(key)] = self._coerced(value, here)
        return out

    def _auto(self, model: type[BaseModel], key: str, here: tuple[str, ...]) -> None:
        dotted = ".".join(here)
        later = resolves_later(dotted)
        if later is not None:
            self.pending[dotted] = later
        elif dotted in BATCH_KEYS:
            rule = "follows from the other batch numbers and the world size (train = micro × accumulation × world)"
            self.notes.append(Note(self.shown(here), f"`{self.shown(here)}: auto` {rule}"))
        else:
            default = field_default(model, key)
            self.notes.append(Note(self.shown(here), f"`{self.shown(here)}: auto` became {default!r} (the default)"))

    def _offload(self, value: Any, here: tuple[str, ...]) -> dict[str, Any] | None:
        """An offload section: `none` is off, `cpu` and `nvme` are kept for `resolve` to check (`nvme` with the
        keys that act)."""
        shown = self.shown(here)
        if value is None:  # the default: nothing to say
            return None
        if value is False:
            self.notes.append(Note(shown, f"`{shown}: false` leaves ZeRO-Offload off, as in shardwise: ignored"))
            return None
        if not isinstance(value, Mapping):
            self.problems.append(f"`{shown}`: got {shown_value(value)}; expected a mapping such as `{{device: cpu}}`")
            return None
        unknown = sorted(str(k) for k in value if k not in OFFLOAD_KEYS)
        for key in unknown:
            self._unknown_in(here, key, OFFLOAD_KEYS)
        device = str(coerce(value.get("device", "none"))).strip().lower()
        if device in ("none", "auto", ""):
            self.notes.append(Note(shown, f"`{shown}` leaves ZeRO-Offload off (`device: none`), as in shardwise: ignored"))
            return None
        if device not in ("cpu", "nvme"):
            self.problems.append(
                f"`{shown}.device: {device}` is not an offload device; expected `cpu`, `nvme` or `none`; "
                "set one of them or remove the section")
            return None
        acting = (_NVME_ACTING if device == "nvme" else _CPU_ACTING)[here[-1]]
        out: dict[str, Any] = {"device": device}
        for key in sorted(acting & {str(k) for k in value}):
            out[key] = value[key] if key == "nvme_path" else self._coerced(value[key], (*here, key))
        if tuning := sorted(str(k) for k in value if k in OFFLOAD_KEYS and k != "device" and k not in acting):
            names = ", ".join(f"`{k}`" for k in tuning)
            self.notes.append(Note(shown, f"`{shown}`: {names} ignored (they tune the offload itself)"))
        return out

    def _judge(self, entry: Entry, value: Any, here: tuple[str, ...]) -> None:
        shown = self.shown(here)
        if entry.feature is None or (entry.reason and entry.is_off(coerce(value))):
            self.notes.append(Note(shown, f"`{shown}` ignored: {entry.reason}"))
        elif entry.is_off(coerce(value)):
            self.notes.append(Note(shown, f"`{shown}` leaves {entry.feature} off, as in shardwise: ignored"))
        else:
            self.problems.append(
                f"`{shown}` turns on {entry.feature}, a DeepSpeed feature shardwise does not implement; {entry.fix}")

    def _unknown(self, model: type[BaseModel], here: tuple[str, ...]) -> None:
        if len(self.problems) >= MAX_SHOWN:  # not shown: skip the search (200k keys took minutes)
            self.problems.append(problem_line(self.shown(here), "unknown", "remove it"))
            return
        level = ".".join(here[:-1])
        siblings = [p.rsplit(".", 1)[-1] for p in CATALOG if p.rpartition(".")[0] == level]
        self._unknown_in(here[:-1], here[-1], [*model.model_fields, *siblings, *ALIASES.get(level, {})])

    def _unknown_in(self, section: tuple[str, ...], key: str, known: Any) -> None:
        hint = suggest(key, known) if len(self.problems) < MAX_SHOWN else "remove it"
        self.problems.append(problem_line(self.shown((*section, key)), "unknown", hint))
