"""A test's `embedfleet worker`, forked from tests/forks.py's server against started fresh:
``python -m loadtest.worker_start --rounds 3``.

Each round starts one worker each way, alternating, in the tests' environment (the torch
backend, no int8 copy, eager queries, one torch thread: tests/conftest.py ``worker_env`` and
tests/one_thread.py), on a fresh local Redis, and times it from the call to its `bulk slice cost
seeded` log line: the wall seconds, and the process's own CPU seconds (/proc) at that line. The
fork server is started before the first round (its imports are paid once per test process, and
are not in these figures). The figures and the CPU they were taken on: docs/DEVELOPMENT.md
("Commands forked, not started").
"""

from __future__ import annotations

import os

# as the Makefile runs the tests (the fork server takes this process's environment)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from loadtest.common import redis_server
from tests import forks

READY_LINE = b"bulk slice cost seeded"
# the tests' worker (tests/conftest.py worker_env, tests/one_thread.py)
TEST_WORKER_ENV = {
    "EMBEDFLEET_CPU_BACKEND": "torch",
    "EMBEDFLEET_CPU_INT8": "false",
    "EMBEDFLEET_FROZEN_QUERIES": "false",
    "EMBEDFLEET_BLOCK_MS": "200",
    "EMBEDFLEET_LOG_FORMAT": "json",
    "EMBEDFLEET_THREADS": "1",
}


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def time_one_start(env: dict[str, str], log: Path, *, fresh: bool) -> tuple[float, float]:
    """(wall, CPU) seconds from the call to the worker's ready line; the worker is then killed."""
    started = time.perf_counter()
    with log.open("wb") as log_file:
        process = forks.popen(
            ["worker"], env=env, stdout=subprocess.DEVNULL, stderr=log_file, fresh=fresh
        )
    try:
        while READY_LINE not in log.read_bytes():
            if process.poll() is not None:
                raise RuntimeError(f"the worker exited: {log.read_text()[-3000:]}")
            time.sleep(0.02)  # the log line is the event; the poll only bounds its lateness
        wall = time.perf_counter() - started
        return wall, _cpu_seconds(process.pid)
    finally:
        process.kill()
        process.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="starts each way (default 3)")
    rounds = parser.parse_args(argv).rounds
    forks.server_environment()  # the server up, its imports out of the figures
    figures: dict[str, list[tuple[float, float]]] = {"forked": [], "fresh": []}
    with redis_server() as server, tempfile.TemporaryDirectory() as folder:
        for round_number in range(rounds):
            for way in figures:
                env = {
                    **forks.server_environment(),
                    **TEST_WORKER_ENV,
                    "EMBEDFLEET_REDIS_URL": server.url,
                    "EMBEDFLEET_NAMESPACE": f"start-{way}-{round_number}",
                }
                log = Path(folder) / f"{way}-{round_number}.log"
                figures[way].append(time_one_start(env, log, fresh=way == "fresh"))
    for way, rows in figures.items():
        walls = ", ".join(f"{wall:.2f}" for wall, _ in rows)
        cpus = ", ".join(f"{cpu:.2f}" for _, cpu in rows)
        print(f"{way:>6}: ready in {walls} s of wall; {cpus} CPU s")
    ratio = statistics.median(
        fresh[1] / forked[1] for forked, fresh in zip(*figures.values(), strict=True)
    )
    print(f"fresh / forked CPU seconds to ready, median of rounds: {ratio:.2f}")


if __name__ == "__main__":
    main()
