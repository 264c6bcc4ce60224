"""The type and lint gates run with the suite, so a red check fails CI like a red test.

Both read their settings from pyproject.toml (``[tool.mypy]``, ``[tool.ruff]``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=280)


def test_mypy_reports_no_errors_in_the_package() -> None:
    done = _run("mypy")
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_reports_nothing() -> None:
    done = _run("ruff", "check", "--no-cache", ".")
    assert done.returncode == 0, done.stdout + done.stderr
