"""The CPU worker image: built with `make image` (buildah, a Debian base from mmdebstrap, wheels
from the host), then run as its non-root user: `embedfleet --help`, and a worker that embeds 50
chunks from this test's Redis on loopback with parity against sentence-transformers.

Needs root, buildah and mmdebstrap (CI installs them with apt). Elsewhere it skips, except under
CI, where a missing tool is a failure rather than a quiet skip.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from embedfleet import Producer
from embedfleet.producer.chunker import builtin_corpus
from embedfleet.shared.protocol import Chunk
from embedfleet.shared.settings import Settings

pytestmark = pytest.mark.image

REPO = Path(__file__).resolve().parents[1]
BUILD_TIMEOUT_S = 1500


def _image_name() -> str:
    version = re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M)
    assert version
    return f"embedfleet/embedfleet:{version.group(1)}"


def _require_tools() -> None:
    missing = [tool for tool in ("buildah", "mmdebstrap") if shutil.which(tool) is None]
    problem = f"missing {', '.join(missing)}" if missing else None
    if problem is None and os.geteuid() != 0:
        problem = "buildah with chroot isolation needs root here"
    if problem:
        message = f"image test: {problem} (apt-get install buildah mmdebstrap; run as root)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def image() -> str:
    _require_tools()
    started = time.monotonic()
    subprocess.run(
        ["make", "image", f"VENV={sys.prefix}"],
        cwd=REPO,
        check=True,
        timeout=BUILD_TIMEOUT_S,
    )
    print(f"make image: {time.monotonic() - started:.0f} s")
    name = _image_name()
    size = subprocess.run(
        ["buildah", "images", "--format", "{{.Size}}", name],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    print(f"{name}: {size}")
    return name


@pytest.fixture(scope="module")
def container(image: str) -> Iterator[str]:
    name = subprocess.run(
        ["buildah", "from", "--pull=never", image], capture_output=True, text=True, check=True
    ).stdout.strip()
    yield name
    subprocess.run(["buildah", "rm", name], capture_output=True, check=False)


def _run_in(container: str, *command: str, env: dict[str, str] | None = None) -> list[str]:
    """`buildah run` as the image's own user (the Dockerfile's USER), with extra variables."""
    user = re.search(r"^USER (\S+)$", (REPO / "Dockerfile").read_text(), re.M)
    assert user
    flags = [f"--env={key}={value}" for key, value in (env or {}).items()]
    return [
        "buildah",
        "run",
        "--isolation",
        "chroot",
        f"--user={user.group(1)}",
        *flags,
        container,
        "--",
        *command,
    ]


def test_help_runs_as_the_non_root_user(container: str) -> None:
    who = subprocess.run(
        _run_in(container, "sh", "-c", "id -u; embedfleet --help"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert who.returncode == 0, who.stderr
    uid, *help_text = who.stdout.splitlines()
    assert uid == "10001"
    assert any(line.strip().startswith("worker") for line in help_text), who.stdout


async def test_worker_in_the_image_embeds_with_parity(container: str, settings: Settings) -> None:
    from sentence_transformers import SentenceTransformer

    chunks = [Chunk(id=c.id, text=c.text) for c in builtin_corpus(50)]
    worker = subprocess.Popen(
        _run_in(
            container,
            "embedfleet",
            "worker",
            env={
                "EMBEDFLEET_REDIS_URL": settings.effective_redis_url,
                "EMBEDFLEET_NAMESPACE": settings.namespace,
                "EMBEDFLEET_THREADS": "1",
                "EMBEDFLEET_LOG_FORMAT": "json",
            },
        ),
        start_new_session=True,
    )
    try:
        async with Producer(settings) as producer:
            await producer.enqueue(chunks, job="image")
            progress = await producer.wait_for_job("image", timeout=600)
            results = {r.id: r async for r in producer.results(job="image")}
    finally:
        os.killpg(worker.pid, signal.SIGTERM)  # drains, then exits
        try:
            worker.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
    assert progress.done == 50 and progress.dead == 0
    assert set(results) == {c.id for c in chunks}

    from embedfleet.workers.encoder import PACKAGED_MODEL, resolve_model_path

    model_dir = resolve_model_path(PACKAGED_MODEL)  # the same packaged model, on the host
    reference = SentenceTransformer(str(model_dir), device="cpu").encode([c.text for c in chunks])
    ours = np.stack([results[c.id].vector.astype(np.float32) for c in chunks])
    cosines = (ours * reference).sum(1) / (
        np.linalg.norm(ours, axis=1) * np.linalg.norm(reference, axis=1)
    )
    print(f"image worker parity over 50 texts: min cosine {cosines.min():.6f}")
    assert cosines.min() >= 0.999
