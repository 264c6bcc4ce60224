"""The type and lint gates run with the suite, so a red check fails CI like a red test.

Both read their settings from pyproject.toml (``[tool.mypy]``, ``[tool.ruff]``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from _import_graph import cycles, edges, run_time, uncommented_deferred

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=280)


def test_mypy_reports_no_errors_in_the_package() -> None:
    done = _run("mypy")
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_reports_nothing() -> None:
    done = _run("ruff", "check", "--no-cache", ".")
    assert done.returncode == 0, done.stdout + done.stderr




# The circles kept, each with its reason (docs/architecture.md, "Import circles kept"). Compared for equality:
# a new circle fails, and so does one that is gone but still listed.
#: circles kept on purpose, each with its reason in docs/architecture.md ("Import circles kept"): none now
_CIRCLES_KEPT: list[list[str]] = []


def test_the_package_has_no_import_cycle_counting_imports_inside_functions() -> None:
    found = edges(ROOT / "src" / "shardwise", "shardwise")
    assert len(found) > 100, f"the import graph has only {len(found)} edges: the parser lost imports"
    assert cycles(run_time(found)) == []


def test_no_import_circle_counting_type_checking_imports_but_those_kept() -> None:
    found = edges(ROOT / "src" / "shardwise", "shardwise")
    assert sum(edge.typing_only for edge in found) > 10, "the parser lost the imports under `if TYPE_CHECKING:`"
    assert cycles(found) == _CIRCLES_KEPT


def test_every_import_inside_a_function_says_why() -> None:
    assert uncommented_deferred(ROOT / "src" / "shardwise", "shardwise") == []


def test_the_import_graph_sees_a_loop_made_inside_functions(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\n"
                                  "def f():\n    from .a import x\n")
    (package / "c.py").write_text("from .b import f\n")
    (package / "d.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    pass\nelse:\n    import pkg.c\n")
    found = edges(package, "pkg")
    assert cycles(run_time(found)) == [["pkg.a", "pkg.b"]]  # b -> c is under TYPE_CHECKING: never runs
    assert cycles(found) == [["pkg.a", "pkg.b", "pkg.c"]]  # but a reader still follows it
    assert [(e.source, e.target) for e in found if e.typing_only] == [("pkg.b", "pkg.c")]
    assert ("pkg.d", "pkg.c", False) in [(e.source, e.target, e.typing_only) for e in found]  # the `else:` runs
    assert uncommented_deferred(package, "pkg") == ["pkg.b:5"]


def test_importing_shardwise_does_not_import_the_test_harness() -> None:
    code = ("import sys, shardwise; assert 'shardwise.testing' not in sys.modules; "
            "from shardwise.testing import run_distributed; assert shardwise.testing.run_distributed is run_distributed")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0, done.stderr
