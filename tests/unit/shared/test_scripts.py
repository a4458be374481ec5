"""The Redis scripts: one .lua file each, with its KEYS/ARGV header, loaded by one loader, and
shipped in the wheel."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from embedfleet.gateway.batch import SCRIPTS_PACKAGE as BATCH_SCRIPTS
from embedfleet.shared import scripts
from tests.paths import REPO_ROOT

REPO = REPO_ROOT
# every folder that holds scripts: the fleet's shared ones, and the parts' own beside them
SCRIPT_PACKAGES = (scripts.__name__, BATCH_SCRIPTS)


@pytest.mark.parametrize("package", SCRIPT_PACKAGES)
def test_every_script_loads_with_its_header(package: str) -> None:
    found = scripts.names(package)
    assert found
    for name in found:
        text = scripts.load(name, package)
        assert text.startswith("--") and "redis.call" in text


def test_the_batch_apis_scripts_lie_beside_it_and_no_name_is_in_two_folders() -> None:
    assert {"enqueue", "replay_dead_letter"} <= set(scripts.names())
    batch_scripts = {"create_batch", "end_batch", "release_lease", "renew_lease", "save_batch"}
    assert set(scripts.names(BATCH_SCRIPTS)) == batch_scripts
    assert not batch_scripts & set(scripts.names()), "a Batch API script left in shared/scripts"
    with pytest.raises(scripts.ScriptError, match=r"no Redis script end_batch\.lua"):
        scripts.load("end_batch")  # named with its package only


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
    assert offenders == [], f"move these scripts to .lua files: {offenders}"


@pytest.mark.packaging
def test_the_wheel_ships_the_scripts(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(REPO)],
        check=True,
        capture_output=True,
    )
    [wheel] = tmp_path.glob("embedfleet-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for package in SCRIPT_PACKAGES:
        folder = package.replace(".", "/")
        for name in scripts.names(package):
            assert f"{folder}/{name}.lua" in names
