"""tests/forks.py: a command forked from the pre-imported server ends as a fresh interpreter's
would (its output, its exit status, a signal's), and runs fresh where its environment could not
be the server's."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path
from subprocess import DEVNULL, PIPE

import pytest

from tests import forks

# the slow tier (make test-full, CI): the fork server is a process that imports torch
pytestmark = pytest.mark.slow


def _both(*args: str | bytes, **extra: str) -> tuple[subprocess.CompletedProcess[bytes], ...]:
    env = {**forks.server_environment(), **extra}
    forked = forks.run(args, env=env, timeout=120)
    fresh = forks.run(args, env=env, timeout=120, fresh=True)
    return forked, fresh


@pytest.mark.parametrize(
    "args",
    [
        ("--help",),  # exit 0, stdout
        ("worker", "--no-such-flag"),  # click's usage error: exit 2, stderr
        ("status", "--sample", b"\xff\xfe"),  # argv not UTF-8: decoded as a fresh one does
    ],
    ids=["help", "usage", "bytes"],
)
def test_a_forked_command_ends_as_a_fresh_one(args: tuple[str | bytes, ...]) -> None:
    forked, fresh = _both(*args, EMBEDFLEET_REDIS_URL="redis://127.0.0.1:1/0")
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        fresh.returncode,
        fresh.stdout,
        fresh.stderr,
    )
    assert b"Traceback" not in forked.stderr and b"RuntimeWarning" not in forked.stderr


def test_a_signal_ends_a_forked_command_and_its_cpu_is_counted() -> None:
    before = forks.reaped_cpu_seconds()
    env = {**forks.server_environment(), "EMBEDFLEET_REDIS_URL": "redis://127.0.0.1:1/0"}
    # a worker loads its model, then waits on the closed port: seconds, whatever the machine
    process = forks.popen(["worker"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert isinstance(process, forks.ForkedProcess) and process.poll() is None
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL
    assert forks.reaped_cpu_seconds() > before


def test_an_environment_the_server_could_not_have_runs_fresh() -> None:
    env = {**forks.server_environment(), "HOME": "/nonexistent-home"}
    process = forks.popen(["--help"], env=env, stdout=subprocess.DEVNULL)
    assert isinstance(process, subprocess.Popen)
    assert process.wait(timeout=120) == 0
    forked = forks.popen(
        ["--help"],
        env={**forks.server_environment(), "EMBEDFLEET_NAMESPACE": "other"},
        stdout=subprocess.DEVNULL,
    )
    assert isinstance(forked, forks.ForkedProcess)
    assert forked.wait(timeout=120) == 0


@pytest.mark.parametrize(
    ("code", "status"), [(None, 0), (0, 0), (3, 3), (256 + 4, 4), ("a message", 1)]
)
def test_exit_codes_as_the_interpreter_gives_them(
    code: object, status: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert forks._exit_code(code) == status
    assert capsys.readouterr().err == ("a message\n" if isinstance(code, str) else "")
    fresh = subprocess.run([sys.executable, "-c", f"raise SystemExit({code!r})"], check=False)
    assert fresh.returncode == status


async def test_start_gives_what_asyncio_gives_a_fresh_interpreter() -> None:
    """``forks.start`` as ``asyncio.create_subprocess_exec``: the same bytes on stdout and
    stderr, the same exit status; stdin fed and closed by ``communicate``; a line read as it
    comes."""
    env = {**forks.server_environment(), "EMBEDFLEET_REDIS_URL": "redis://127.0.0.1:1/0"}
    for args in (("--help",), ("worker", "--no-such-flag")):
        forked = await forks.start(args, env=env)
        assert isinstance(forked, forks.AsyncProcess)
        fresh = await asyncio.create_subprocess_exec(
            *forks.command_line(args), env=env, stdout=PIPE, stderr=PIPE
        )
        got, want = await forked.communicate(), await fresh.communicate()
        assert (forked.returncode, got) == (fresh.returncode, want)
    # stdin piped: `enqueue -` reads it to its end, then fails on the closed port, as a fresh one
    line = b'{"id": "a", "text": "b"}\n'
    args = ("enqueue", "-", "--job", "j")
    forked = await forks.start(args, env=env, stdin=PIPE)
    assert isinstance(forked, forks.AsyncProcess) and forked.stdin is not None
    fresh = await asyncio.create_subprocess_exec(
        *forks.command_line(args), env=env, stdin=PIPE, stdout=PIPE, stderr=PIPE
    )
    got = await asyncio.wait_for(forked.communicate(line), 120)
    want = await asyncio.wait_for(fresh.communicate(line), 120)
    assert (forked.returncode, got) == (fresh.returncode, want) and forked.returncode == 1
    assert got[1] and b"Traceback" not in got[1]
    # a line read before the end, then the exit awaited
    forked = await forks.start(["--help"], env=env)
    assert forked.stdout is not None
    assert (await asyncio.wait_for(forked.stdout.readline(), 120)).startswith(b"Usage:")
    assert await asyncio.wait_for(forked.wait(), 120) == 0
    # a worker (it loads its model, then waits on the closed port) killed: its exit awaited
    forked = await forks.start(["worker"], env=env, stdout=DEVNULL, stderr=DEVNULL)
    assert forked.returncode is None
    forked.kill()
    assert await asyncio.wait_for(forked.wait(), 60) == -signal.SIGKILL


def test_another_module_runs_as_under_python_m(tmp_path: Path) -> None:
    """``popen(..., module=)``: ``python -m MODULE ARGS``, forked, as a fresh one runs it."""
    env = forks.server_environment()
    outputs = []
    for fresh in (False, True):
        out = tmp_path / f"out-{fresh}"
        with out.open("wb") as handle:
            process = forks.popen(
                ["--help"], env=env, stdout=handle, module="loadtest.host_pipeline", fresh=fresh
            )
            assert isinstance(process, forks.ForkedProcess) != fresh
            assert process.wait(timeout=120) == 0
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1] and b"python -m loadtest.host_pipeline" in outputs[0]
