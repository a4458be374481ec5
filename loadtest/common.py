"""Pieces the load scenarios share: a server, worker processes, percentiles, RSS."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from embedfleet.server import ServerProcess, preferred_server_binary
from embedfleet.shared.settings import Settings


@contextlib.contextmanager
def redis_server() -> Iterator[ServerProcess]:
    """A fresh server for one scenario: Debian's redis-server when present, else Valkey."""
    with ServerProcess(preferred_server_binary()) as server:
        yield server


@contextlib.contextmanager
def worker_process(settings: Settings, name: str, **env: str) -> Iterator[subprocess.Popen[bytes]]:
    """`embedfleet worker` as its own process, drained with SIGTERM on exit."""
    environment = {
        **os.environ,
        "EMBEDFLEET_REDIS_URL": settings.effective_redis_url,
        "EMBEDFLEET_NAMESPACE": settings.namespace,
        "EMBEDFLEET_CONSUMER": name,
        "EMBEDFLEET_LOG_FORMAT": "json",
        "EMBEDFLEET_LOG_LEVEL": "warning",
        **env,
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "embedfleet.cli", "worker"],
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def percentile_ms(samples: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples) * 1000, q))


def rss_mib(pid: int) -> float:
    """Resident set size of a process, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def machine_load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} cores"
