"""The package type-checks: mypy over the tree, with pyproject.toml's [tool.mypy] settings; ruff
finds nothing (check and format).

Run as `make lint` runs it (from the repository root, `python -m tools.import_root --mypy`:
mypy over the package as the wheel lays it out, each file once), so the config alone says what
is checked and how strictly. A cold run (no .mypy_cache) takes a minute or two.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.paths import REPO_ROOT

REPOSITORY_ROOT = REPO_ROOT


@pytest.mark.slow
@pytest.mark.beside
def test_mypy_finds_no_errors() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tools.import_root", "--mypy"],
        cwd=REPOSITORY_ROOT,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert result.returncode == 0, (
        f"mypy exited with {result.returncode}; fix the errors below (or, where a library's "
        f"types are wrong, a narrow `# type: ignore[code]` saying why):\n"
        f"{result.stdout}{result.stderr}"
    )


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_is_clean(command: list[str]) -> None:
    """`make lint`'s ruff, in the suite CI runs: a module moved or edited without it once
    landed with its imports out of order (ruff's own config in pyproject.toml)."""
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "."],
        cwd=REPOSITORY_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"ruff {' '.join(command)} .:\n{result.stdout}{result.stderr}"
