"""Pieces the load scenarios share: a server, fleet processes, settings, percentiles, RSS."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from embedfleet.server import ServerProcess, preferred_server_binary
from embedfleet.shared.settings import Settings


@contextlib.contextmanager
def redis_server() -> Iterator[ServerProcess]:
    """A fresh server for one scenario: Debian's redis-server when present, else Valkey."""
    with ServerProcess(preferred_server_binary()) as server:
        yield server


Reported = TypeVar("Reported")


def run_on_redis(redis_url: str, scenario: Callable[[str], Awaitable[Reported]]) -> Reported:
    """``scenario(url)`` on the server at ``redis_url``, or on a fresh one (:func:`redis_server`)
    where it is empty."""
    if redis_url:
        return asyncio.run(scenario(redis_url))
    with redis_server() as server:
        return asyncio.run(scenario(server.url))


def print_report(report: Any, text: str, json_path: Path | None) -> None:
    """``text`` (the dataclass ``report`` rendered) printed, and the report as JSON at
    ``json_path`` when one is given (--json)."""
    print(text)
    if json_path is not None:
        json_path.write_text(json.dumps(dataclasses.asdict(report), indent=1) + "\n")


@contextlib.contextmanager
def embedfleet_process(
    command: str, environment: Mapping[str, str], stop_timeout_s: float
) -> Iterator[subprocess.Popen[bytes]]:
    """`embedfleet <command>` as its own process, output discarded unless LOADTEST_PROCESS_LOG
    names a file to append it to (to see why a benchmark's worker failed); SIGTERM on exit (a
    worker drains on it), SIGKILL when it has not exited within ``stop_timeout_s``."""
    log_path = os.environ.get("LOADTEST_PROCESS_LOG")
    with contextlib.ExitStack() as stack:
        output = stack.enter_context(open(log_path, "ab")) if log_path else subprocess.DEVNULL
        process = subprocess.Popen(
            [sys.executable, "-m", "embedfleet.cli", command],
            env={**os.environ, **environment},
            stdout=output,
            stderr=output,
        )
        try:
            yield process
        finally:
            process.terminate()
            try:
                process.wait(timeout=stop_timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()


@contextlib.contextmanager
def worker_process(settings: Settings, name: str, **env: str) -> Iterator[subprocess.Popen[bytes]]:
    """`embedfleet worker` as its own process, drained with SIGTERM on exit."""
    environment = {
        "EMBEDFLEET_REDIS_URL": settings.effective_redis_url,
        "EMBEDFLEET_NAMESPACE": settings.namespace,
        "EMBEDFLEET_CONSUMER": name,
        "EMBEDFLEET_LOG_FORMAT": "json",
        "EMBEDFLEET_LOG_LEVEL": "warning",
        # benchmarks measure the pipeline: no text answered from the vector cache (issue 31)
        "EMBEDFLEET_VECTOR_CACHE_MB": "0",
        **env,
    }
    with embedfleet_process("worker", environment, stop_timeout_s=60) as process:
        yield process


def add_plot_argument(parser: argparse.ArgumentParser, draws: str) -> None:
    """Every scenario's ``--plot FILE.png`` (loadtest/plots.py draws it); ``draws`` says what."""
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        help=f"also draw {draws} to this PNG (needs matplotlib)",
    )


def percentile_ms(samples: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples) * 1000, q))


def rss_mib(pid: int) -> float:
    """Resident set size of a process, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_name() -> str:
    """The CPU's model name, for the machine line of a scenario's report."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


# The flags that decide the model's fast paths (bf16 and int8 units, AVX2), in the order a
# figure names them: a throughput figure means little without them (issue 43).
MODEL_FLAGS = ("amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx2")


def cpu_identity(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """The CPU a figure was measured on: its model name, family and model numbers (a KVM guest
    may show a generic name), and which of :data:`MODEL_FLAGS` it has (as /proc/cpuinfo lists
    them, not capped at what torch dispatches to)."""
    from embedfleet.workers.cpus import cpu_flags

    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if not line.strip():
                break  # the first processor's block is enough
            fields.setdefault(key.strip(), value.strip())
    flags = cpu_flags(cpuinfo)
    return {
        "name": fields.get("model name") or platform.processor() or platform.machine(),
        "family": fields.get("cpu family", ""),
        "model": fields.get("model", ""),
        "flags": [flag for flag in MODEL_FLAGS if flag in flags],
    }


def cpu_line(identity: Mapping[str, Any] | None = None) -> str:
    """``<name> (family F model M; <flags>)``: the CPU as a report's machine line names it."""
    cpu = identity or cpu_identity()
    numbers = f"family {cpu['family']} model {cpu['model']}; " if cpu["family"] else ""
    flags = " ".join(cpu["flags"]) or f"none of {' '.join(MODEL_FLAGS)}"
    return f"{cpu['name']} ({numbers}{flags})"


def machine_load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} cores"
