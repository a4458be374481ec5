"""`embedfleet` commands forked from one interpreter that has imported them, one per test process.

A test's `embedfleet worker` spent about two thirds of its start importing (torch, transformers'
model classes, the command line's verbs: 8 of 12 CPU seconds on a Zen 4 guest, py-spy), and the
full suite starts about sixty of them (docs/DEVELOPMENT.md, "CI time"). The server here imports
those modules once per pytest process; each command is forked from it and runs `embedfleet.cli`
as ``python -m embedfleet.cli ARGS`` does (``runpy``, as ``__main__``), in the environment, folder
and standard streams the test gave, and ends through the interpreter's own shutdown. Only the
imports are shared: from ``main`` on, the command is its own process.

A command runs in a fresh interpreter (``subprocess``) instead when its environment differs from
the server's in anything but EMBEDFLEET_* variables (HOME, HF_*, a CPU ISA cap: libraries the
server imported read such variables at import), or when the test asks for one (``fresh=True``: a
start's own cost or a process's memory is what it measures).

The server (``python -m tests.forks SOCKET``) is single-threaded: it forks only while no other
thread runs, and it runs no torch operation before forking (an OpenMP pool does not survive a
fork). It exits when the test process closes its standard input.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import json
import os
import runpy
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, NoReturn

from embedfleet.workers.model.telemetry import ORT_SWITCH

# What the server imports before it forks: the command line, the worker's runtime and encoder,
# and the packaged model's transformers classes (which `AutoModel` imports lazily at load)
PRELOADED = (
    "embedfleet.cli",
    "embedfleet.workers.runtime",
    "embedfleet.workers.model.encoder",
    "transformers.models.bert.modeling_bert",
)
# the variables a forked command may set differently from the server's environment: read at run
# time, never at import by a library the server imported. EMBEDFLEET_*: embedfleet's settings.
# TORCHINDUCTOR_CACHE_DIR: read when a graph compiles (torch writes its default into the test
# process's environment at its first compile). ORT_SWITCH: ONNX Runtime's telemetry switch, which
# workers/model/telemetry.py sets in a process that built an engine's copy (the server never
# imports ONNX Runtime). TOKENIZERS_PARALLELISM: read by the tokenizers library at each batch
# encoding (the server encodes none).
FORKABLE_PREFIXES = ("EMBEDFLEET_",)
FORKABLE_NAMES = frozenset(
    {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", ORT_SWITCH, "TOKENIZERS_PARALLELISM"}
)
_HEADER = struct.Struct("!I")
CLI_MODULE = "embedfleet.cli"


def command_line(args: Sequence[str | bytes], module: str = CLI_MODULE) -> list[str | bytes]:
    """``python -m embedfleet.cli ARGS`` (or another ``module``): what a fresh interpreter runs,
    and what a forked command reports as its ``args``."""
    return [sys.executable, "-m", module, *args]


# ---- the server (its own process) ----


def _receive_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    header, fds, _flags, _address = socket.recv_fds(conn, _HEADER.size, 3)
    (length,) = _HEADER.unpack(header)
    payload = b""
    while len(payload) < length:
        chunk = conn.recv(length - len(payload))
        if not chunk:
            raise ConnectionError("the test process closed the request")
        payload += chunk
    return json.loads(payload), fds


def serve(path: str) -> dict[str, Any] | None:
    """Serve forks on ``path`` until standard input closes; returns None there, and in a forked
    child returns its request (argv, env, cwd) with its standard streams in place."""
    for module in PRELOADED:
        __import__(module)
    # what is imported stays out of every child's garbage collections: a collection that walked
    # it would copy the pages it touched into each child
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through the pipe
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_read, selectors.EVENT_READ, "reap")
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "parent")
    children: dict[int, socket.socket] = {}
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        for key, _events in selector.select():
            if key.data == "parent":
                if not os.read(sys.stdin.fileno(), 4096):
                    return None  # the test process is gone
            elif key.data == "reap":
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_read, 4096)
                _reap(children)
            else:
                conn, _ = listener.accept()
                try:
                    request, fds = _receive_request(conn)
                except (ConnectionError, OSError, ValueError):
                    conn.close()
                    continue
                if threading.active_count() != 1:
                    raise RuntimeError("the fork server must fork with one thread")
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    # the child: drop the server's state, then take the test's streams
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    selector.close()
                    listener.close()
                    os.close(wake_read)
                    os.close(wake_write)
                    for other in children.values():
                        other.close()
                    conn.close()
                    for target, fd in enumerate(fds):
                        os.dup2(fd, target)
                    for fd in fds:
                        if fd > 2:
                            os.close(fd)
                    return request
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                with contextlib.suppress(OSError):  # a test process gone meanwhile
                    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _reap(children: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        report = {
            "returncode": os.waitstatus_to_exitcode(status),
            "cpu": usage.ru_utime + usage.ru_stime,
        }
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps(report).encode() + b"\n")
        conn.close()


def _run_command(request: dict[str, Any]) -> NoReturn:
    """In the forked child: `python -m MODULE ARGS` from here on (`embedfleet.cli` unless the
    request names another), to the exit status the interpreter would give."""
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = ["-m", *request["argv"]]
    module = request.get("module", CLI_MODULE)
    # as under `python -m`, the module runs only as __main__ (runpy warns of it imported before)
    if sys.modules.pop(module, None) is not None:
        parent, _, name = module.rpartition(".")
        if parent in sys.modules and hasattr(sys.modules[parent], name):
            delattr(sys.modules[parent], name)
    interrupted = False
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit:
        code = _exit_code(exit.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code, interrupted = 1, True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    # The interpreter's shutdown, less its teardown of every module: that teardown touches each
    # object the server imported, copying its pages (about a CPU second a command, for nothing)
    threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads, as at exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if interrupted:  # as CPython ends on an unhandled Ctrl-C: killed by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _exit_code(code: object) -> int:
    """The exit status of ``SystemExit(code)``, as the interpreter gives it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


# ---- the client (in the test process) ----


class ForkedProcess:
    """A forked command, as much of ``subprocess.Popen`` as the tests use: ``pid``,
    ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``."""

    def __init__(self, args: list[str], conn: socket.socket) -> None:
        self.args = args
        self._conn = conn
        self._reader = conn.makefile("rb")
        started = json.loads(self._reader.readline() or b"{}")
        if "pid" not in started:
            raise RuntimeError("the fork server did not start the command")
        self.pid: int = started["pid"]
        self.returncode: int | None = None

    def fileno(self) -> int:
        """Readable once the command has ended (the server's report): for an event loop."""
        return self._conn.fileno()

    def _settle(self, timeout: float | None) -> int | None:
        if self.returncode is not None:
            return self.returncode
        ready, _, _ = select.select([self._conn], [], [], timeout)
        if not ready:
            return None
        line = self._reader.readline()
        report = json.loads(line) if line else {"returncode": -signal.SIGKILL, "cpu": 0.0}
        _reaped_cpu[0] += report["cpu"]
        self.returncode = report["returncode"]
        self._reader.close()
        self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        return self._settle(0)

    def wait(self, timeout: float | None = None) -> int:
        returncode = self._settle(timeout)
        if returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# what ``popen`` returns: a forked command, or a fresh interpreter's
Process = ForkedProcess | subprocess.Popen[bytes]


# CPU seconds of the forked commands that ended, for tests/timing.py: they are the server's
# children, so the test process's RUSAGE_CHILDREN never counts them
_reaped_cpu = [0.0]


def reaped_cpu_seconds() -> float:
    return _reaped_cpu[0]


def _process_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


class _Server:
    def __init__(self) -> None:
        self.env = dict(os.environ)
        self.folder = tempfile.mkdtemp(prefix="embedfleet-forks-")
        self.path = os.path.join(self.folder, "socket")
        self.log = Path(self.folder) / "server.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.forks", self.path],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=self.env,
                cwd=Path(__file__).resolve().parent.parent,
            )
        assert self.process.stdout is not None
        if self.process.stdout.readline() != b"ready\n":
            raise RuntimeError(f"the fork server did not start: {self.log.read_text()}")
        # its imports are this process's CPU too (it is reaped only when the session ends)
        _reaped_cpu[0] += _process_cpu_seconds(self.process.pid)

    def forkable(self, env: Mapping[str, str]) -> bool:
        names = env.keys() | self.env.keys()
        differing = [
            name
            for name in names
            if env.get(name) != self.env.get(name)
            and not name.startswith(FORKABLE_PREFIXES)
            and name not in FORKABLE_NAMES
        ]
        return not differing

    def spawn(
        self,
        argv: list[str],
        env: Mapping[str, str],
        cwd: str,
        streams: Sequence[int],
        module: str = CLI_MODULE,
    ) -> ForkedProcess:
        if self.process.poll() is not None:
            raise RuntimeError(f"the fork server exited: {self.log.read_text()}")
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        request = {"argv": argv, "env": dict(env), "cwd": cwd, "module": module}
        payload = json.dumps(request).encode()
        socket.send_fds(conn, [_HEADER.pack(len(payload))], list(streams))
        conn.sendall(payload)
        return ForkedProcess(argv, conn)

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


_server: _Server | None = None
_server_lock = threading.Lock()


def _the_server() -> _Server:
    global _server
    with _server_lock:
        if _server is None:
            _server = _Server()
            atexit.register(_server.close)
        return _server


def server_environment() -> dict[str, str]:
    """The environment the server was started with: a command whose environment differs from it
    only in the variables above is forked."""
    return dict(_the_server().env)


def _stream_fd(stream: int | IO[Any] | None, mode: int, opened: list[int]) -> int:
    """A file descriptor for one of the child's standard streams, as Popen reads its
    ``stdin``/``stdout``/``stderr`` arguments (None: the test process's own)."""
    if stream is None:
        return mode  # 0, 1 or 2: the test process's own stream
    if stream == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        opened.append(fd)
        return fd
    if isinstance(stream, int):
        return stream
    return stream.fileno()


def popen(
    args: Sequence[str | bytes],
    *,
    env: Mapping[str, str],
    stdin: int | IO[Any] | None = None,
    stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None,
    cwd: str | Path | None = None,
    fresh: bool = False,
    module: str = CLI_MODULE,
) -> Process:
    """`embedfleet ARGS` (``python -m MODULE ARGS`` for another module): forked when it may be
    (above), else ``subprocess.Popen`` of that command line. Streams: None, DEVNULL, a file
    descriptor or a file; pipes are ``run``'s and ``start``'s."""
    argv = [os.fsdecode(arg) for arg in args]
    if fresh or not _the_server().forkable(env):
        return subprocess.Popen(
            command_line(args, module),
            env=dict(env),
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            cwd=cwd,
        )
    opened: list[int] = []
    try:
        fds = [
            _stream_fd(stream, number, opened)
            for number, stream in enumerate((stdin, stdout, stderr))
        ]
        return _the_server().spawn(argv, env, str(cwd or os.getcwd()), fds, module)
    finally:
        for fd in opened:
            os.close(fd)


def run(
    args: Sequence[str | bytes],
    *,
    env: Mapping[str, str],
    input: bytes | str | None = None,
    timeout: float | None = None,
    cwd: str | Path | None = None,
    text: bool = False,
    fresh: bool = False,
) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run([python, -m, embedfleet.cli, *args], capture_output=True, ...)``, the
    command forked when it may be: its stdout and stderr as bytes, or (``text``) as
    ``subprocess.run`` decodes them."""
    if fresh or not _the_server().forkable(env):
        return subprocess.run(
            command_line(args),
            env=dict(env),
            input=input,
            capture_output=True,
            timeout=timeout,
            cwd=cwd,
            text=text,
        )
    if isinstance(input, str):
        input = input.encode()
    done = _run_forked(args, env=env, input=input, timeout=timeout, cwd=cwd)
    if text:  # as subprocess decodes text: the locale's encoding, universal newlines
        done.stdout, done.stderr = (_text(done.stdout), _text(done.stderr))
    return done


def _text(data: bytes) -> str:
    import locale

    decoded = data.decode(locale.getpreferredencoding(False))
    return decoded.replace("\r\n", "\n").replace("\r", "\n")


def _run_forked(
    args: Sequence[str | bytes],
    *,
    env: Mapping[str, str],
    input: bytes | None,
    timeout: float | None,
    cwd: str | Path | None,
) -> subprocess.CompletedProcess[bytes]:
    stdin_read, stdin_write = os.pipe()
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    try:
        process = popen(
            args, env=env, stdin=stdin_read, stdout=out_write, stderr=err_write, cwd=cwd
        )
    finally:
        for fd in (stdin_read, out_write, err_write):
            os.close(fd)
    captured: dict[int, bytes] = {}

    def drain(fd: int) -> None:
        with open(fd, "rb") as pipe:
            captured[fd] = pipe.read()

    def feed() -> None:
        with open(stdin_write, "wb") as pipe, contextlib.suppress(BrokenPipeError):
            if input:
                pipe.write(input)

    threads = [
        threading.Thread(target=drain, args=(out_read,), daemon=True),
        threading.Thread(target=drain, args=(err_read,), daemon=True),
        threading.Thread(target=feed, daemon=True),
    ]
    for thread in threads:
        thread.start()
    try:
        returncode = process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    for thread in threads:
        thread.join()
    return subprocess.CompletedProcess(
        command_line(args), returncode, captured[out_read], captured[err_read]
    )


# ---- asyncio's side: ``asyncio.create_subprocess_exec`` for a forked command ----


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class AsyncProcess:
    """A forked command as much like ``asyncio.subprocess.Process`` as the tests use it:
    ``pid``, ``returncode``, ``stdin`` (a StreamWriter), ``stdout`` and ``stderr``
    (StreamReaders) where piped, ``wait``, ``communicate``, ``send_signal``, ``terminate``,
    ``kill``."""

    def __init__(
        self,
        process: ForkedProcess,
        stdin: asyncio.StreamWriter | None,
        stdout: asyncio.StreamReader | None,
        stderr: asyncio.StreamReader | None,
    ) -> None:
        self._process = process
        self.pid = process.pid
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr

    @property
    def returncode(self) -> int | None:
        return self._process.poll()

    async def wait(self) -> int:
        loop = asyncio.get_running_loop()
        while (code := self._process.poll()) is None:
            ended = loop.create_future()
            fd = self._process.fileno()
            loop.add_reader(fd, _resolve, ended)
            try:
                await ended
            finally:
                loop.remove_reader(fd)
        return code

    async def communicate(self, input: bytes | None = None) -> tuple[bytes | None, bytes | None]:
        """As asyncio's: ``input`` written to stdin, which is then closed (left open without
        ``input``); stdout and stderr read to their ends; the exit awaited."""

        async def feed() -> None:
            if self.stdin is None or input is None:
                return
            self.stdin.write(input)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                await self.stdin.drain()
            self.stdin.close()

        async def read(stream: asyncio.StreamReader | None) -> bytes | None:
            return None if stream is None else await stream.read()

        _, out, err = await asyncio.gather(feed(), read(self.stdout), read(self.stderr))
        await self.wait()
        return out, err

    def send_signal(self, signum: int) -> None:
        self._process.send_signal(signum)

    def terminate(self) -> None:
        self._process.terminate()

    def kill(self) -> None:
        self._process.kill()


async def start(
    args: Sequence[str],
    *,
    env: Mapping[str, str],
    stdin: int | None = None,
    stdout: int | None = subprocess.PIPE,
    stderr: int | None = subprocess.PIPE,
) -> AsyncProcess | asyncio.subprocess.Process:
    """``asyncio.create_subprocess_exec(python, -m, embedfleet.cli, *args, ...)``, forked when
    it may be; each stream None (the test process's own), ``subprocess.PIPE`` or DEVNULL."""
    if not _the_server().forkable(env):
        return await asyncio.create_subprocess_exec(
            *command_line(args), env=dict(env), stdin=stdin, stdout=stdout, stderr=stderr
        )
    loop = asyncio.get_running_loop()
    child_ends: list[int | None] = []
    ours: list[int | None] = []
    for number, stream in enumerate((stdin, stdout, stderr)):
        if stream == subprocess.PIPE:
            read, write = os.pipe()
            child_ends.append(read if number == 0 else write)
            ours.append(write if number == 0 else read)
        else:
            child_ends.append(stream)
            ours.append(None)
    try:
        process = popen(
            args, env=env, stdin=child_ends[0], stdout=child_ends[1], stderr=child_ends[2]
        )
    except BaseException:
        for fd in ours:
            if fd is not None:
                os.close(fd)
        raise
    finally:
        for fd, stream in zip(child_ends, (stdin, stdout, stderr), strict=True):
            if stream == subprocess.PIPE and fd is not None:
                os.close(fd)
    assert isinstance(process, ForkedProcess)
    writer = None
    if ours[0] is not None:
        transport, protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(ours[0], "wb", buffering=0)
        )
        writer = asyncio.StreamWriter(transport, protocol, None, loop)
    readers: list[asyncio.StreamReader | None] = []
    for fd in ours[1:]:
        if fd is None:
            readers.append(None)
            continue
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(
            lambda reader=reader: asyncio.StreamReaderProtocol(reader),
            os.fdopen(fd, "rb", buffering=0),
        )
        readers.append(reader)
    return AsyncProcess(process, writer, readers[0], readers[1])


if __name__ == "__main__":
    request = serve(sys.argv[1])
    if request is not None:
        _run_command(request)
