"""`make wheelhouse` reads the requirements from pyproject.toml (tools/wheelhouse.py) instead
of building the project: the same requirements pip resolves for ``'.[worker]'`` and
``'.[gateway]'``, the project's own extras expanded, never the project itself."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from tools.wheelhouse import PYPROJECT, requirements


def test_the_worker_set_is_the_dependencies_and_the_worker_extra() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    expected = project["dependencies"] + project["optional-dependencies"]["worker"]
    assert requirements(["worker"]) == list(dict.fromkeys(expected))


def test_an_extra_naming_the_project_is_expanded_not_built(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        '[project]\nname = "embedfleet"\ndependencies = ["redis>=5"]\n'
        "[project.optional-dependencies]\n"
        'documents = ["tokenizers>=0.20", "redis>=5"]\n'
        'gateway = ["embedfleet[documents]", "fastapi>=0.115", "uvicorn[standard]>=0.30"]\n'
    )
    assert requirements(["gateway"], pyproject) == [
        "redis>=5",
        "tokenizers>=0.20",
        "fastapi>=0.115",
        "uvicorn[standard]>=0.30",
    ]
    gateway = requirements(["gateway"])
    assert not any(line.startswith("embedfleet") for line in gateway)
    assert any(line.startswith("fastapi") for line in gateway)
    assert any(line.startswith("tokenizers") for line in gateway)  # from [documents]


def test_an_unknown_extra_names_the_ones_there_are() -> None:
    with pytest.raises(SystemExit, match=r"no extra 'wrker'.*'worker'"):
        requirements(["wrker"])
