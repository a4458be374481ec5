"""What a person sees: `embedfleet demo` in a real pseudo-terminal, read off a VT100 screen.

The demo's output bytes (progress bar frames, carriage returns, colour codes, log lines) are
fed to ``pyte``, a terminal emulator, 120 columns wide like a usual terminal window; the test
then reads the screen as text, as a person would, and checks that no log line starts inside a
progress-bar line and that no third-party warning reaches it.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pyte
import pytest

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model. Not
# serial: it reads the screen's layout and words, no time (test-full's parallel tier)
pytestmark = pytest.mark.slow

COLUMNS = 120
ROWS = 400  # taller than the whole run: nothing scrolls away before it is read

TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d")
BAR = re.compile(r"^embedding: +\d+%\|.*\| *\d+/\d+ \[")
# a bar frame's last field: `[00:12<00:00, 3.2 texts/s]`, or `1.39s/ texts]` when slower
BAR_END = re.compile(r"\[[^\[\]]*(texts/s|s/ texts)\]$")
THIRD_PARTY = re.compile(
    r"\[(transformers|torch|tokenizers|huggingface_hub|sentence_transformers|py\.warnings)\b"
    r"|\w+Warning: |loss_type="
)


def run_in_terminal(args: list[str], env: dict[str, str], timeout: float = 300) -> list[str]:
    """Run ``args`` with a pseudo-terminal as stdin/stdout/stderr; return the final screen."""
    leader, follower = os.openpty()
    # the window size tqdm reads to size its bar (TIOCGWINSZ)
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))
    process = subprocess.Popen(
        args,
        stdin=follower,
        stdout=follower,
        stderr=follower,
        env={**env, "COLUMNS": str(COLUMNS), "TERM": "xterm-256color"},
        start_new_session=True,
        close_fds=True,
    )
    os.close(follower)
    screen = pyte.Screen(COLUMNS, ROWS)
    stream = pyte.ByteStream(screen)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if not ready:
                continue
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: every process holding the terminal has exited
                break
            if not data:
                break
            stream.feed(data)
        else:
            raise TimeoutError(f"{args} still running after {timeout} s")
        assert process.wait(timeout=30) == 0, "\n".join(_lines(screen))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(leader)
    return _lines(screen)


def _lines(screen: pyte.Screen) -> list[str]:
    lines = [line.rstrip() for line in screen.display]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def test_demo_screen_keeps_logs_above_the_bar_and_no_third_party_warnings(
    tmp_path: Path,
) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("EMBEDFLEET_")}
    # but no int8 copy (as every test worker, tests/conftest.py): on a CPU with VNNI or AMX the
    # demo's worker would compile the W8A8 copy first, up to two minutes of CI on 2 cores; the
    # copy itself is tests/integration/workers/test_int8.py's, this test is the screen's layout and
    # its warnings
    env["EMBEDFLEET_CPU_INT8"] = "false"
    # and torch's path (as every test worker): where bf16 is native the class default exports
    # OpenVINO's copy at start, tests/integration/workers/model/test_backends.py's
    env["EMBEDFLEET_CPU_BACKEND"] = "torch"
    screen = run_in_terminal(
        [
            sys.executable,
            "-m",
            "embedfleet.cli",
            "demo",
            "--limit",
            "40",
            "--out-dir",
            str(tmp_path),
        ],
        env=env,
    )
    text = "\n".join(screen)
    print(text)  # the screen, for whoever reads a failure

    bars = [line for line in screen if BAR.search(line)]
    assert bars, "no progress bar on the screen"
    for line in bars:
        # a bar line ends with its own closing bracket, nothing after it
        assert BAR_END.search(line), f"something was written into the bar: {line!r}"
    for line in screen:
        stamp = TIMESTAMP.search(line)
        # a log line starts at the left edge; a timestamp further right is a torn line
        assert stamp is None or stamp.start() == 0, f"a log line starts mid-line: {line!r}"
    assert "worker started" in text, "the worker's log lines (written while the bar runs) are gone"
    assert "frozen query graph" in text or "queries run eager" in text
    assert not THIRD_PARTY.search(text), "a third-party warning reached the user's screen"
    assert any("40/40" in line for line in bars), "the bar's final frame is gone"
    assert "embedded 40 texts" in text
