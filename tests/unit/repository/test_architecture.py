"""docs/ARCHITECTURE.md, the newcomer's map, held against the tree: every module and name it
gives exists, and every package of the tree has its row, so a move that forgets the map fails
here instead of leaving the map wrong."""

from __future__ import annotations

import ast
import re

import pytest

from tests.paths import REPO_ROOT

MAP = REPO_ROOT / "docs" / "ARCHITECTURE.md"
# the folders that install under the import root (pyproject.toml's package-dir)
INSTALLED_FOLDERS = ("embedfleet", "shared", "producer", "workers")
# the folders of the checkout that do not install: benchmarks, tests, the repository tools
NOT_INSTALLED = ("loadtest", "tests", "tools")


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


def _defined_names(source: str) -> set[str]:
    """The names a module defines at its top level: a class, a function or an assignment.
    A name it only imports is not among them, so the map points at the module that defines
    what a step names, not at one that re-exports it (a package's ``__init__``)."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


STEPS = _table_rows("Steps")


def test_the_map_has_its_steps_and_rooms() -> None:
    assert len(STEPS) >= 30
    assert len(_table_rows("Rooms")) >= len(INSTALLED_FOLDERS)


@pytest.mark.parametrize(("step", "module", "name"), STEPS, ids=[row[0] for row in STEPS])
def test_each_step_names_a_module_that_defines_its_name(step: str, module: str, name: str) -> None:
    path = REPO_ROOT / module.strip("`")
    assert path.is_file(), f"{step}: {module} is not a file of the tree"
    assert name.strip("`") in _defined_names(path.read_text()), (
        f"{step}: {module} defines no {name} (a name it only imports does not count: name the "
        "module that defines it)"
    )


def test_a_name_a_module_only_imports_is_not_defined_there() -> None:
    source = (
        "from embedfleet.shared.settings.composed import Settings\n"
        "import os\n"
        "class Keys: ...\n"
        "def verify(): ...\n"
        "async def serve(): ...\n"
        "LIMIT = 3\n"
        "card: int = 1\n"
        "if True:\n"
        "    NESTED = 1\n"
    )
    assert _defined_names(source) == {"Keys", "verify", "serve", "LIMIT", "card"}


def test_every_path_the_map_names_exists() -> None:
    named = set(re.findall(r"\b((?:[a-z_]+/)+[a-z_]*(?:\.py|\.lua)?)", MAP.read_text()))
    # paths inside the tree only (links to other docs and URLs are test_docs's)
    named = {p for p in named if p.split("/")[0] in {*INSTALLED_FOLDERS, *NOT_INSTALLED}}
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
    assert not (rooms - packages - {*NOT_INSTALLED, "helm"}), "rooms that are no package"
