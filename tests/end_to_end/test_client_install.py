"""`pip install embedfleet` is the client: it installs without torch, under one import root, and
its verbs work against a running server.

Installs this checkout into a fresh virtual environment (build and dependencies from PyPI), so it
costs half a minute and a network; marked `packaging`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from embedfleet.shared.settings import Settings
from tests.paths import REPO_ROOT

pytestmark = pytest.mark.packaging

REPO = REPO_ROOT
# What the venv sees of this process's environment: no PYTHONPATH pointing at the checkout.
CLEAN_ENV = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    venv = tmp_path_factory.mktemp("client-venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", str(REPO)],
        check=True,
        timeout=600,
        cwd=venv,  # not the checkout, whose folders would shadow the installed package
        env=CLEAN_ENV,
    )
    yield venv


def _run(
    venv: Path, program: str, *args: str, env: dict[str, str] = CLEAN_ENV, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``program`` of the venv (python, pip, embedfleet), run in the venv's folder: not the
    checkout, whose folders would shadow the installed package."""
    return subprocess.run(
        [str(venv / "bin" / program), *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=venv,
        env=env,
        timeout=120,
    )


def _python(venv: Path, code: str) -> subprocess.CompletedProcess[str]:
    return _run(venv, "python", "-c", code)


def test_client_installs_without_torch_under_one_root(client_venv: Path) -> None:
    imported = _python(client_venv, "from embedfleet import Producer; print(Producer.__module__)")
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip() == "embedfleet.producer.client"

    show = _run(client_venv, "pip", "show", "torch")
    assert show.returncode != 0, "the client must not pull torch"
    for heavy in ("torch", "transformers", "tokenizers"):
        found = _python(client_venv, f"import importlib.util as u; print(u.find_spec({heavy!r}))")
        assert found.stdout.strip() == "None", f"{heavy} is installed with the client"

    for name in ("shared", "workers", "producer", "loadtest"):
        assert _python(client_venv, f"import {name}").returncode != 0, f"top-level {name!r}"
    site = next((client_venv / "lib").glob("python3*/site-packages"))
    assert not {"shared", "workers", "producer", "loadtest", "tests"} & {
        path.name for path in site.iterdir()
    }
    assert (site / "embedfleet" / "workers" / "worker.py").is_file()


def test_worker_without_the_extra_says_what_to_install(client_venv: Path) -> None:
    worker = _run(client_venv, "embedfleet", "worker")
    assert worker.returncode != 0
    lines = worker.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'embedfleet[worker]'" in lines[0], worker.stderr


def test_enqueue_and_status_from_the_client_venv(client_venv: Path, settings: Settings) -> None:
    env = {
        "PATH": f"{client_venv / 'bin'}:/usr/bin:/bin",
        "EMBEDFLEET_REDIS_URL": settings.effective_redis_url,
        "EMBEDFLEET_NAMESPACE": settings.namespace,
    }
    chunks = "".join(
        json.dumps({"id": f"c{i}", "text": f"chunk number {i}"}) + "\n" for i in range(7)
    )
    args = ("enqueue", "-", "--job", "client")
    enqueue = _run(client_venv, "embedfleet", *args, env=env, stdin=chunks)
    assert enqueue.returncode == 0, enqueue.stderr
    assert "enqueued 7 chunks as job 'client'" in enqueue.stdout

    status = _run(client_venv, "embedfleet", "status", "--json", "--sample", "0", env=env)
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    jobs = {job["job"]: job for job in report["jobs"]}
    assert jobs["client"]["enqueued"] == 7 and jobs["client"]["done"] == 0, report
