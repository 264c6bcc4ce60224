"""docs/architecture.md's layout names every module of the package, and only modules that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "shardwise"


def _listed() -> set[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## Layout"): text.index("## Import circles kept")]
    files = set(re.findall(r"^\| `([\w/]+\.py)` \|", section, re.MULTILINE))
    for folder in re.findall(r"^### `([\w/]+)/`", section, re.MULTILINE):
        files.add(f"{folder}/__init__.py")  # a folder's heading is its package docstring
    return files


def test_the_layout_lists_every_module_and_no_other() -> None:
    actual = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts}
    listed = _listed()
    assert not actual - listed, f"modules missing from docs/architecture.md's layout: {sorted(actual - listed)}"
    assert not listed - actual, f"docs/architecture.md lists modules that do not exist: {sorted(listed - actual)}"
