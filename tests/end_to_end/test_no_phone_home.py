"""Nothing is sent anywhere (docs/DESIGN's qualities): an `embedfleet worker` started as a user
starts it, under an empty HOME, connects to nothing but its Redis and listens on nothing but its
health port, and leaves no file under HOME: with the default backend, and with ``auto``, which
imports, builds, gates and times every installed engine's copy (ONNX Runtime, OpenVINO) in one
start. OpenVINO's import alone used to send an event to Google Analytics and write ``~/intel``
(workers/model/telemetry.py).
Beside the default backend's worker, an `embedfleet serve` with its gRPC doors, under the same
hook and HOME, answers a TEI gRPC Embed and an embedfleet.v1 Embed reaching nothing but its
Redis and binding nothing but its ports."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from embedfleet.server import ServerProcess, free_port
from embedfleet.shared.settings import Settings
from embedfleet.workers.model.backends import ENGINES, installed
from tests.conftest import require_slow_tier, worker_env

# the slow tier: each test starts an `embedfleet worker` process and builds an engine's copy
pytestmark = pytest.mark.slow

# Loaded by the worker's interpreter at start (PYTHONPATH): an audit hook that appends every
# lookup, connection, datagram and bind made through Python's socket module, in the worker and in
# any process it forks (OpenVINO's telemetry sent from a fork), to NET_AUDIT_LOG as JSON lines.
# Connections made by native code (uvloop's Redis sockets, a library's own C++ client) do not
# pass through it: those are covered by the files under HOME, where each engine's telemetry keeps
# its client id and its queue.
SITECUSTOMIZE = """
import json, os, sys

_LOG = os.environ["NET_AUDIT_LOG"]
_EVENTS = ("socket.getaddrinfo", "socket.connect", "socket.sendto", "socket.sendmsg", "socket.bind")


def _audit(event, args):
    if event not in _EVENTS:
        return
    if event == "socket.getaddrinfo":
        host, port = args[0], args[1]
    else:
        address = args[-1] if event in ("socket.sendto", "socket.sendmsg") else args[1]
        host, port = (address[0], address[1]) if isinstance(address, tuple) else (address, None)
    if isinstance(host, bytes):
        host = host.decode(errors="replace")
    record = {"pid": os.getpid(), "event": event, "host": str(host), "port": port}
    fd = os.open(_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (json.dumps(record) + "\\n").encode())
    finally:
        os.close(fd)


sys.addaudithook(_audit)
"""

# what the worker logs once its forward path is chosen (the engine's copy built, gated and
# kept or refused) and its query stage serves: everything a start does is done by then
READY_LINE = '"query stage ready"'


def _entry_point() -> str:
    """The `embedfleet` command installed beside this interpreter (the venv's bin), as a user
    runs it."""
    command = Path(sys.executable).with_name("embedfleet")
    assert command.is_file(), f"{command} is missing: pip install -e '.[worker]' into this venv"
    return str(command)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _elsewhere(records: list[dict], redis_port: int, ports: tuple[int, ...]) -> list[dict]:
    """The records of a lookup, connection or bind other than the process's Redis and its own
    ports on loopback."""
    return [
        record
        for record in records
        if not (
            (record["event"] == "socket.bind" and record["port"] in ports)
            or (_is_loopback(record["host"]) and record["port"] in (redis_port, *ports))
        )
    ]


def _audited(path: Path) -> list[dict]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines]


async def _gateway_reaches(env: dict[str, str], tmp_path: Path, redis_port: int) -> list[dict]:
    """`embedfleet serve` with gRPC, as a user starts it, under ``env``'s hook and HOME: a TEI
    gRPC Embed and a fleet Embed answered (the worker beside it embeds), then stopped; what it
    reached beyond its Redis and its ports."""
    import grpc

    from embedfleet.gateway.fleet_grpc import fleet_pb2
    from embedfleet.gateway.grpc_services import stub
    from embedfleet.gateway.tei_grpc import tei_pb2

    http_port, grpc_port = free_port(), free_port()
    audit, log = tmp_path / "gateway-net.jsonl", tmp_path / "gateway.log"
    env = env | {
        "NET_AUDIT_LOG": str(audit),
        "EMBEDFLEET_GATEWAY_PORT": str(http_port),
        "EMBEDFLEET_GATEWAY_GRPC_PORT": str(grpc_port),
        "EMBEDFLEET_FILES_DIR": str(tmp_path / "files"),
    }
    with log.open("wb") as log_file:
        process = subprocess.Popen(
            [_entry_point(), "serve"], env=env, stdout=subprocess.DEVNULL, stderr=log_file
        )
    try:
        await _until_logged(process, log, '"gateway started"')  # gRPC listens by then

        def embed() -> None:
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                tei_embed = stub(channel, tei_pb2.DESCRIPTOR.services_by_name["Embed"])
                fleet = stub(channel, fleet_pb2.DESCRIPTOR.services_by_name["Fleet"])
                tei = tei_embed.Embed(tei_pb2.EmbedRequest(inputs="a"))
                ours = fleet.Embed(fleet_pb2.EmbedRequest(inputs=["a"]))
            assert len(tei.embeddings) == ours.dim > 0

        await asyncio.wait_for(asyncio.to_thread(embed), 300)
        process.send_signal(signal.SIGTERM)
        # uvicorn ends a clean shutdown by raising the signal again
        assert process.wait(timeout=60) in (0, -signal.SIGTERM), log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    records = _audited(audit)
    assert records, "the audit hook saw nothing of the gateway: not even its HTTP port's bind"
    return _elsewhere(records, redis_port, (http_port, grpc_port))


async def _until_logged(process: subprocess.Popen[bytes], log: Path, text: str) -> None:
    """Until the worker's log holds ``text`` (read every 50 ms: the line is the signal)."""
    async with asyncio.timeout(300):
        while text not in log.read_text(errors="replace"):
            if process.poll() is not None:
                raise AssertionError(f"worker exited before logging {text}: {log.read_text()}")
            await asyncio.sleep(0.05)


# `auto` builds every installed engine's copy, as a worker naming each one would (one start
# instead of one per engine: CI's CPU seconds); `default` builds the one adopted for this CPU
@pytest.mark.parametrize("backend", ["default", "auto"])
async def test_a_worker_sends_nothing_and_writes_nothing_under_home(
    backend: str, settings: Settings, redis_server: ServerProcess, tmp_path: Path
) -> None:
    require_slow_tier("an `embedfleet worker` process")
    home, site = tmp_path / "home", tmp_path / "site"
    home.mkdir()
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    audit, log = tmp_path / "net.jsonl", tmp_path / "worker.log"
    health_port = free_port()
    env = worker_env(
        settings,
        HOME=str(home),
        PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
        NET_AUDIT_LOG=str(audit),
        EMBEDFLEET_CPU_BACKEND=backend,
        # the backend's copy is built for the query path (worker_env runs queries eager)
        EMBEDFLEET_FROZEN_QUERIES="true",
        EMBEDFLEET_HEALTH_PORT=str(health_port),
        EMBEDFLEET_CONSUMER=f"quiet-{backend}",
    )
    # every library's default place is under HOME, where the test looks
    for variable in ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME"):
        env.pop(variable, None)
    with log.open("wb") as log_file:
        process = subprocess.Popen(
            [_entry_point(), "worker"], env=env, stdout=subprocess.DEVNULL, stderr=log_file
        )
    try:
        await _until_logged(process, log, READY_LINE)
        gateway = []
        if backend == "default":  # the gateway's doors, once, beside a worker that answers
            gateway = await _gateway_reaches(env, tmp_path, redis_server.port)
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert code == 0, log.read_text()
    if backend == "auto":  # every installed engine's copy was built, not skipped
        made = {
            json.loads(line).get("backend")
            for line in log.read_text().splitlines()
            if '"backend copy made"' in line
        }
        assert made == {engine for engine in ENGINES if installed(engine)}, log.read_text()

    written = sorted(str(path.relative_to(home)) for path in home.rglob("*"))
    records = _audited(audit)
    assert records, "the audit hook saw nothing: not even the health port's bind"
    elsewhere = _elsewhere(records, redis_server.port, (health_port,))
    # all at once: a failure names every file and every address
    assert (written, elsewhere, gateway) == ([], [], []), (
        f"the worker and gateway wrote under HOME {written}, the worker reached beyond its "
        f"Redis and health port {elsewhere}, the gateway beyond its Redis and ports {gateway}"
    )
