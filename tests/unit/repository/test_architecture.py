"""docs/ARCHITECTURE.md, the newcomer's map, held against the tree: every module and name it
gives exists, and every package of the tree has its row, so a move that forgets the map fails
here instead of leaving the map wrong."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.paths import REPO_ROOT

MAP = REPO_ROOT / "docs" / "ARCHITECTURE.md"
# the folders that install under the import root (pyproject.toml's package-dir)
INSTALLED_FOLDERS = ("embedfleet", "shared", "producer", "workers")


def _section(title: str) -> str:
    text = MAP.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def _table_rows(title: str) -> list[list[str]]:
    rows = []
    for line in _section(title).splitlines():
        if line.startswith("|") and not set(line) <= set("|- "):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows[1:]  # the header


def _top_level_names(module: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom):  # a package's __init__ re-exports its names
            names.update(alias.asname or alias.name for alias in node.names)
    return names


STEPS = _table_rows("Steps")


def test_the_map_has_its_steps_and_rooms() -> None:
    assert len(STEPS) >= 30
    assert len(_table_rows("Rooms")) >= len(INSTALLED_FOLDERS)


@pytest.mark.parametrize(("step", "module", "name"), STEPS, ids=[row[0] for row in STEPS])
def test_each_step_names_a_module_that_defines_its_name(step: str, module: str, name: str) -> None:
    path = REPO_ROOT / module.strip("`")
    assert path.is_file(), f"{step}: {module} is not a file of the tree"
    assert name.strip("`") in _top_level_names(path), f"{step}: {module} defines no {name}"


def test_every_path_the_map_names_exists() -> None:
    named = set(re.findall(r"\b((?:[a-z_]+/)+[a-z_]*(?:\.py|\.lua)?)", MAP.read_text()))
    # paths inside the tree only (links to other docs and URLs are test_docs's)
    named = {p for p in named if p.split("/")[0] in {*INSTALLED_FOLDERS, "loadtest", "tests"}}
    missing = sorted(p for p in named if not (REPO_ROOT / p).exists())
    assert named and not missing, f"the map names paths the tree does not have: {missing}"


def test_every_package_of_the_tree_has_a_room() -> None:
    rooms = {row[1].strip("`").rstrip("/") for row in _table_rows("Rooms")}
    packages = {
        str(init.parent.relative_to(REPO_ROOT))
        for folder in INSTALLED_FOLDERS
        for init in (REPO_ROOT / folder).rglob("__init__.py")
    }
    assert packages <= rooms, f"packages with no row in Rooms: {sorted(packages - rooms)}"
    assert not (rooms - packages - {"loadtest", "tests", "helm"}), "rooms that are no package"
