"""The images: the CPU worker (`make image`) and the gateway (`make image-gateway`), built with
buildah on a Debian base from mmdebstrap and wheels from the host (nothing pulled), then run as
their non-root user: `embedfleet --help`; a worker that embeds 50 chunks from this test's Redis
on loopback with parity against sentence-transformers; the gateway image (no torch in it) serving
`/v1/models` and `/v1/embeddings` to the openai SDK in front of the worker image. Each image is
built once per session.

Needs root, buildah and mmdebstrap (CI installs them with apt). Elsewhere those tests skip, except
under CI, where a missing tool is a failure rather than a quiet skip. `make image` without the
tools (a fresh clone) is checked here too, without building anything.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from embedfleet import Producer
from embedfleet.producer.chunker import builtin_corpus
from embedfleet.server import free_port
from embedfleet.shared.protocol import Chunk
from embedfleet.shared.settings import PACKAGED_MODEL as PACKAGED_MODEL_NAME
from embedfleet.shared.settings import Settings
from tests.gateway_support import wait_for_worker
from tests.paths import REPO_ROOT

REPO = REPO_ROOT
BUILD_TIMEOUT_S = 1500
# the first test's setup builds both images (the session fixture below): pytest's own 600 s must
# not cut a build the fixture allows BUILD_TIMEOUT_S. On an AVX2-only Zen 2 beside the two xdist
# workers of `make test-full` the build took over 600 s.
pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + 300)
IMAGE_TOOLS = ("buildah", "mmdebstrap")


def _image_name(suffix: str = "") -> str:
    version = re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M)
    assert version
    return f"embedfleet/embedfleet:{version.group(1)}{suffix}"


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


@pytest.fixture(scope="session")
def images() -> dict[str, str]:
    """`make image image-gateway` (one make, one wheelhouse step), then the images' names. The
    venv running the tests is installed already: `-o` keeps make from reinstalling it (a venv
    shared with other checkouts must not be)."""
    _require_tools()
    started = time.monotonic()
    # `make test-full` makes the wheelhouse before it starts this module beside the rest of the
    # suite (both build the project in this tree; see the Makefile), and says so here
    made = ["-o", "wheelhouse"] if os.environ.get("EMBEDFLEET_TEST_WHEELHOUSE") == "made" else []
    subprocess.run(
        [
            "make",
            "image",
            "image-gateway",
            f"VENV={sys.prefix}",
            "-o",
            f"{sys.prefix}/.installed",
            *made,
        ],
        cwd=REPO,
        check=True,
        timeout=BUILD_TIMEOUT_S,
    )
    print(f"make image image-gateway: {time.monotonic() - started:.0f} s")
    names = {"worker": _image_name(), "gateway": _image_name("-gateway")}
    for name in names.values():
        size = subprocess.run(
            ["buildah", "images", "--format", "{{.Size}}", name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        print(f"{name}: {size}")
    return names


@pytest.fixture(scope="session")
def image(images: dict[str, str]) -> str:
    return images["worker"]


@pytest.fixture(scope="session")
def gateway_image(images: dict[str, str]) -> str:
    return images["gateway"]


@contextlib.contextmanager
def _working_container(image: str) -> Iterator[str]:
    name = subprocess.run(
        ["buildah", "from", "--pull=never", image], capture_output=True, text=True, check=True
    ).stdout.strip()
    try:
        yield name
    finally:
        subprocess.run(["buildah", "rm", name], capture_output=True, check=False)


@pytest.fixture(scope="module")
def container(image: str) -> Iterator[str]:
    with _working_container(image) as name:
        yield name


@pytest.fixture(scope="module")
def gateway_container(gateway_image: str) -> Iterator[str]:
    with _working_container(gateway_image) as name:
        yield name


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


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM (a worker drains, the gateway shuts down), SIGKILL if it does not exit."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.mark.image
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
    # the gateway has an image of its own; this one lacks its extra, and says so
    serve = subprocess.run(
        _run_in(container, "embedfleet", "serve"), capture_output=True, text=True, timeout=120
    )
    assert serve.returncode != 0
    assert "embedfleet[gateway]" in serve.stderr, serve.stderr


@pytest.mark.image
async def test_worker_in_the_image_embeds_with_parity(container: str, settings: Settings) -> None:
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
        _stop(worker)
    assert progress.done == 50 and progress.dead == 0
    assert set(results) == {c.id for c in chunks}

    ours = np.stack([results[c.id].vector.astype(np.float32) for c in chunks])
    cosines = _cosines_to_reference(ours, [c.text for c in chunks])
    print(f"image worker parity over 50 texts: min cosine {cosines.min():.6f}")
    assert cosines.min() >= 0.999


def _cosines_to_reference(vectors: np.ndarray, texts: list[str]) -> np.ndarray:
    """Row-wise cosines of ``vectors`` to sentence-transformers' embeddings of ``texts``."""
    from sentence_transformers import SentenceTransformer

    from embedfleet.workers.model.encoder import PACKAGED_MODEL, resolve_model_path

    model_dir = resolve_model_path(PACKAGED_MODEL)  # the same packaged model, on the host
    reference = SentenceTransformer(str(model_dir), device="cpu").encode(texts)
    return (vectors * reference).sum(1) / (
        np.linalg.norm(vectors, axis=1) * np.linalg.norm(reference, axis=1)
    )


# --------------------------------------------------------------------------- the gateway image

GATEWAY_TEXTS = [
    "How do I open a file in Python?",
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map text to vectors.",
]


@pytest.mark.image
def test_gateway_image_runs_serve_without_torch(gateway_container: str) -> None:
    probe = subprocess.run(
        _run_in(
            gateway_container,
            "sh",
            "-c",
            "id -u; python3 -c 'import importlib.util as u; print(u.find_spec(\"torch\"))'; "
            "embedfleet serve --help",
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr
    uid, torch_spec, *help_text = probe.stdout.splitlines()
    assert uid == "10001"
    assert torch_spec == "None", "the gateway image must not carry torch"
    assert any("/v1/embeddings" in line for line in help_text), probe.stdout


@pytest.mark.image
def test_gateway_image_serves_models_and_embeddings(
    gateway_container: str, container: str, settings: Settings
) -> None:
    """The two images side by side on this test's Redis (buildah's chroot isolation shares the
    host's network): the worker image embeds, the gateway image answers the openai SDK."""
    import openai

    env = {
        "EMBEDFLEET_REDIS_URL": settings.effective_redis_url,
        "EMBEDFLEET_NAMESPACE": settings.namespace,
        "EMBEDFLEET_LOG_FORMAT": "json",
    }
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    gateway = subprocess.Popen(
        _run_in(
            gateway_container,
            "embedfleet",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            env=env,
        ),
        start_new_session=True,
    )
    worker = subprocess.Popen(
        _run_in(container, "embedfleet", "worker", env=env | {"EMBEDFLEET_THREADS": "1"}),
        start_new_session=True,
    )
    try:
        # ready on Redis alone: it must not wait for a worker
        deadline = time.monotonic() + 120
        with httpx.Client(base_url=base_url, timeout=10) as http:
            while True:
                assert gateway.poll() is None, f"the gateway exited with {gateway.returncode}"
                try:
                    if http.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass  # not listening yet
                assert time.monotonic() < deadline, "the gateway image never became ready"
                time.sleep(0.1)
            wait_for_worker(base_url)
            models = http.get("/v1/models")
        assert models.status_code == 200, models.text
        assert [m["id"] for m in models.json()["data"]] == [
            settings.served_model_name or PACKAGED_MODEL_NAME
        ]

        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        response = client.embeddings.create(
            model=models.json()["data"][0]["id"], input=GATEWAY_TEXTS
        )
        vectors = np.array([d.embedding for d in response.data], dtype=np.float32)
    finally:
        _stop(worker)
        _stop(gateway)
    cosines = _cosines_to_reference(vectors, GATEWAY_TEXTS)
    print(f"gateway image parity over {len(GATEWAY_TEXTS)} texts: min cosine {cosines.min():.6f}")
    assert cosines.min() >= 0.999


# --------------------------------------------------------------------------- a fresh clone


def test_make_image_without_the_tools_says_what_to_install(tmp_path: Path) -> None:
    """`make image` where buildah and mmdebstrap are not installed and no base image was made:
    it names the packages and the Docker alternative, and fails before any slow step (it
    would install the venv first)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for directory in os.environ["PATH"].split(os.pathsep):
        folder = Path(directory)
        if not folder.is_dir():
            continue
        for tool in folder.iterdir():
            target = bin_dir / tool.name
            if tool.name not in IMAGE_TOOLS and not target.exists() and os.access(tool, os.X_OK):
                target.symlink_to(tool)
    venv = tmp_path / "venv"
    make = shutil.which("make")
    assert make, "make is needed to test the Makefile"
    result = subprocess.run(
        [
            make,
            "image",
            f"VENV={venv}",
            f"BUILD_DIR={tmp_path / 'build'}",
            "BASE_IMAGE=localhost/embedfleet-base-never-built:none",
        ],
        cwd=REPO,
        env={**os.environ, "PATH": str(bin_dir)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "needs buildah mmdebstrap" in result.stderr, result.stderr
    assert "apt-get install buildah mmdebstrap" in result.stderr
    assert "docker build" in result.stderr
    assert not venv.exists(), "make image started installing before checking its tools"
