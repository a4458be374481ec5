"""The Redis scripts: one .lua file each, with its KEYS/ARGV header, loaded by one loader, and
shipped in the wheel."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from embedfleet.shared import scripts
from tests.paths import REPO_ROOT

REPO = REPO_ROOT


def test_every_script_loads_with_its_header() -> None:
    found = scripts.names()
    assert {"enqueue", "replay_dead_letter"} <= set(found)
    for name in found:
        text = scripts.load(name)
        assert text.startswith("--") and "redis.call" in text


def test_a_missing_script_is_a_clear_error() -> None:
    with pytest.raises(scripts.ScriptError, match=r"no Redis script nothing\.lua"):
        scripts.load("nothing")


def test_no_python_module_carries_a_lua_body() -> None:
    """Scripts live in their files only: no Python source embeds one (redis.call in a string)."""
    offenders = [
        str(path.relative_to(REPO))
        for folder in ("shared", "producer", "workers", "embedfleet")
        for path in (REPO / folder).rglob("*.py")
        if "redis.call(" in path.read_text() and path.parent.name != "tests"
    ]
    assert offenders == [], f"move these scripts to shared/scripts/*.lua: {offenders}"


@pytest.mark.packaging
def test_the_wheel_ships_the_scripts(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(REPO)],
        check=True,
        capture_output=True,
    )
    [wheel] = tmp_path.glob("embedfleet-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for name in scripts.names():
        assert f"embedfleet/shared/scripts/{name}.lua" in names
