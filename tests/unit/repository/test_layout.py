"""One module, one name: from a checkout, each module of the project loads under the name the
wheel gives it and under no other."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO_ROOT

REPO = REPO_ROOT
CLEAN_ENV = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}


def _python(code: str, *, cwd: Path = REPO, pythonpath: str | None = None) -> str:
    env = dict(CLEAN_ENV, **({"PYTHONPATH": pythonpath} if pythonpath else {}))
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.parametrize(
    "name", ["embedfleet.loadtest", "embedfleet.tests", "embedfleet.embedfleet"]
)
def test_the_import_root_holds_only_the_installed_packages(name: str) -> None:
    found = _python(f"import importlib.util as u; print(u.find_spec({name!r}) is not None)")
    assert found == "False"


@pytest.mark.parametrize("folder", ["shared", "producer", "workers"])
def test_a_folder_does_not_load_as_a_top_level_package(folder: str) -> None:
    """The checkout is on sys.path (the working directory), so the folder is reachable as a
    top-level name: loading it so fails with the name to use instead."""
    said = _python(
        f"try:\n    import {folder}\nexcept ImportError as e:\n    print(e)\n"
        "else:\n    print('loaded')"
    )
    assert said.startswith(f"import embedfleet.{folder}, not {folder}")


def test_outside_the_checkout_the_install_gives_the_same_names() -> None:
    location = Path(_python("import embedfleet.shared.keys as m; print(m.__file__)", cwd=Path("/")))
    assert location == REPO / "shared" / "keys.py"


def test_a_checkout_on_pythonpath_alone_names_modules_as_the_wheel_does(tmp_path: Path) -> None:
    """The device machine cannot install: with PYTHONPATH=checkout (no site-packages at all
    here: -S), embedfleet/__init__.py's finder maps pyproject.toml's package-dir folders to the
    names the wheel gives them, and no other name."""
    code = (
        "import importlib.util as u, embedfleet.shared.exit_codes as m\n"
        "print(m.__file__)\n"
        "print([u.find_spec(n) for n in "
        "('embedfleet.loadtest', 'embedfleet.tests', 'embedfleet.embedfleet')])"
    )
    result = subprocess.run(
        [sys.executable, "-S", "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=dict(CLEAN_ENV, PYTHONPATH=str(REPO)),
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    location, others = result.stdout.strip().splitlines()
    assert Path(location) == REPO / "shared" / "exit_codes.py"
    assert others == "[None, None, None]"


def test_each_file_has_one_path() -> None:
    """No link inside the package's folders: tree walkers, import-graph tools and editors see
    each module once, and a checkout without symlink support gets the same tree."""
    links = [
        str(path.relative_to(REPO))
        for folder in ("embedfleet", "shared", "producer", "workers")
        for path in (REPO / folder).rglob("*")
        if path.is_symlink()
    ]
    assert links == []


def test_the_light_client_imports_none_of_the_verbs() -> None:
    """``embedfleet.producer`` is the client ingestion services import; the operator's verbs
    (``embedfleet.ops``), their click options, the sinks, the worker and the gateway are not
    part of it."""
    loaded = _python(
        "import sys\nfrom embedfleet import Producer\nimport embedfleet.producer, "
        "embedfleet.producer.jsonl, embedfleet.producer.documents, "
        "embedfleet.producer.results_reader\n"
        "print(sorted({m.split('.')[0] if not m.startswith('embedfleet.') "
        "else '.'.join(m.split('.')[:2]) for m in sys.modules}))"
    )
    for name in ("embedfleet.ops", "click", "embedfleet.sinks", "embedfleet.workers"):
        assert f"'{name}'" not in loaded, loaded
    assert "'embedfleet.gateway'" not in loaded and "'torch'" not in loaded, loaded
