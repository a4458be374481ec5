"""One torch thread per pytest-xdist worker, for `make test-full`'s parallel tier.

Two xdist workers on two cores each ran torch (and OpenVINO, ONNX Runtime) on every core, as a
worker does by default: four busy threads on two cores, each pass of the model waiting on a
thread the other process had descheduled. With one thread each, the models the tests load in
process and the `embedfleet worker` processes they start (EMBEDFLEET_THREADS, inherited) share
the cores without spinning on each other. The servers the tests start (Redis, a cluster's six
nodes) stay free to run on any core: pinning each xdist worker to a core of its own also cut
the CPU, but its cluster servers then shared that one core and missed replica confirmations.

Opt-in (``pytest -p tests.one_thread``), and only under xdist or in a lane run beside the rest
(EMBEDFLEET_TEST_ONE_THREAD set: test-full's image lane): a plain ``pytest`` run, and the serial
tier, whose modules measure rates on both cores, keep the worker's default.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    if not (os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get("EMBEDFLEET_TEST_ONE_THREAD")):
        return
    # Worker processes the tests start, and Settings() in this process: one torch thread
    os.environ.setdefault("EMBEDFLEET_THREADS", "1")
    # Encoders built in this process without a thread count (threads=0: "every usable CPU")
    from embedfleet.workers import cpus
    from embedfleet.workers.model import encoder

    def one_cpu(root: Path = cpus.CGROUP_ROOT) -> int:
        return 1

    encoder.usable_cpus = one_cpu
