"""The CLI on bad input (issue 40, point 6, point 9's JSONL part, the 200 MB line): every verb
ends with its documented exit status (shared/exit_codes.py) and a message, never a traceback;
`enqueue` names each bad line and enqueues every good one; a JSONL line keeps every field the
protocol carries. Real `embedfleet` processes against a real redis-server (and a real worker
where the scenario needs the model card it publishes)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np
import pytest
import redis.asyncio as aioredis

from embedfleet.producer.client import Producer
from embedfleet.server import isolated_settings
from embedfleet.shared.exit_codes import ExitCode
from embedfleet.shared.modelcard import read_card
from embedfleet.shared.protocol import Chunk, decode_chunk
from embedfleet.shared.settings import Settings
from tests import forks
from tests.conftest import WorkerLauncher, cli_env, until

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
pytestmark = pytest.mark.slow

TRACEBACK = "Traceback (most recent call last)"
# EAGER: the workers here publish their model card and answer; what is asserted is the CLI's
# exit status and message, never a vector, so they run the eager model without building and
# timing the frozen and int8 copies at start (CPU seconds on CI's slowest class)
# How `embedfleet` is run: the installed module, or (EMBEDFLEET_TEST_CLI_SCRIPT) a script that
# stands in for it, as the closing note's "before" figures were taken with the code of HEAD.
CLI = [sys.executable, *(os.environ.get("EMBEDFLEET_TEST_CLI_SCRIPT", "-m embedfleet.cli").split())]


def embedfleet(
    *args: str | bytes, env: dict[str, str], timeout: float = 300, stdin: bytes | None = None
) -> subprocess.CompletedProcess[str]:
    """`embedfleet ARGS` as a user runs it; ``args`` may hold bytes (an invalid UTF-8 argv)."""
    if os.environ.get("EMBEDFLEET_TEST_CLI_SCRIPT"):
        result = subprocess.run(
            [*CLI, *args], capture_output=True, env=env, input=stdin, timeout=timeout
        )
    else:
        result = forks.run(args, env=env, input=stdin, timeout=timeout)
    return subprocess.CompletedProcess(
        result.args,
        result.returncode,
        result.stdout.decode(errors="replace"),
        result.stderr.decode(errors="replace"),
    )


async def _stream_chunks(client: aioredis.Redis, stream: str) -> list[Chunk]:
    """The chunks on ``stream``, decoded as a worker decodes them."""
    entries = await client.xrange(stream)
    return [decode_chunk(fields[b"m"]) for _, fields in entries]


async def enqueue_rejecting(
    settings: Settings, client: aioredis.Redis, source: Path, job: str
) -> tuple[subprocess.CompletedProcess[str], int]:
    """`embedfleet enqueue SOURCE --job JOB`, which rejects some lines: with their exit status
    and no traceback. Its result and the ingest stream's length after it."""
    result = await asyncio.to_thread(
        embedfleet, "enqueue", str(source), "--job", job, env=cli_env(settings)
    )
    entries = await client.xlen(settings.keys.ingest)
    print(f"exit {result.returncode}, {entries} entries; stderr tail: {result.stderr[-300:]!r}")
    assert TRACEBACK not in result.stderr
    assert result.returncode == ExitCode.REJECTED_LINES
    return result, entries


async def test_invalid_utf8_line_is_named_and_every_good_line_enqueued(
    settings: Settings, client: aioredis.Redis, tmp_path: Path
) -> None:
    """Issue 40's scenario: 5,000 lines, an invalid UTF-8 byte on line 2,501. Before: a
    UnicodeDecodeError traceback, exit 1, 2,000 entries already in the stream (the first two
    batches), no line number."""
    source = tmp_path / "corpus.jsonl"
    lines = [
        json.dumps({"id": f"c{n}", "text": f"chunk number {n}"}).encode() for n in range(1, 5001)
    ]
    lines[2500] = b'{"id": "c2501", "text": "caf\xe9 au lait"}'  # latin-1, not UTF-8
    source.write_bytes(b"\n".join(lines) + b"\n")
    result, entries = await enqueue_rejecting(settings, client, source, "utf8")
    assert "line 2501: " in result.stderr and "UTF-8" in result.stderr
    assert entries == 4999
    assert "enqueued 4999 chunks" in result.stdout


async def test_unknown_prompt_name_rejects_its_line_only(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis, tmp_path: Path
) -> None:
    """A line whose prompt_name the served model does not declare (the model card a real
    worker published says so) is a bad line: named, not enqueued, the others all are. Before:
    a ValueError traceback and nothing enqueued. The worker is stopped once its card is out,
    so the stream's length counts what the enqueue added."""
    worker = workers.process("card", EMBEDFLEET_FROZEN_QUERIES="false")  # see EAGER
    await until(lambda: _card_published(client, settings), timeout=300)
    worker.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(worker.wait, 120) == 0
    source = tmp_path / "corpus.jsonl"
    rows = [{"id": f"p{n}", "text": f"text {n}", "prompt_name": "query"} for n in range(1, 11)]
    rows[3]["prompt_name"] = "no-such-prompt"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result, entries = await enqueue_rejecting(settings, client, source, "prompts")
    assert "line 4: " in result.stderr and "no-such-prompt" in result.stderr
    assert entries == 9
    ids = {chunk.id for chunk in await _stream_chunks(client, settings.keys.ingest)}
    assert ids == {row["id"] for row in rows} - {"p4"}


async def _card_published(client: aioredis.Redis, settings: Settings) -> bool:
    return await read_card(client, settings.keys) is not None


# Every field a chunk's line may carry (protocol: OPTION_NAMES, REPRESENTATION_OPTION_NAMES,
# tenant, meta, reembed), with the values a BGE-M3-shaped corpus and a reranker's pairs use.
FULL_LINES = [
    {
        "id": "m1",
        "text": "hybrid retrieval",
        "meta": {"page": 1},
        "representations": ["dense", "sparse"],
        "max_active_dims": 5,
    },
    {"id": "m2", "text": "what is a panda?", "pair": "The giant panda is a bear."},
    {
        "id": "m3",
        "text": "late interaction",
        "representations": ["multivector"],
        "multivector_dtype": "int8",
        "prompt_name": "query",
        "dimensions": 64,
        "dtype": "float32",
        "reembed": True,
        "tenant": "acme",
    },
    {"id": "m4", "text": "a prompt of its own", "prompt": "passage: ", "unknown_field": 1},
]


async def test_jsonl_line_keeps_every_protocol_field(
    settings: Settings, client: aioredis.Redis, redis_server, tmp_path: Path
) -> None:
    """Point 9 (JSONL): a file's lines give the same stream entries as ``Producer.enqueue`` of
    the same mappings (two namespaces on one server). Before: representations, pair,
    max_active_dims and multivector_dtype were dropped from the file's chunks."""
    source = tmp_path / "full.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in FULL_LINES))
    result = await asyncio.to_thread(
        embedfleet, "enqueue", str(source), "--job", "full", env=cli_env(settings)
    )
    assert TRACEBACK not in result.stderr
    assert result.returncode == ExitCode.OK, result.stderr
    python = isolated_settings(redis_server.url)
    async with Producer(python) as producer:
        await producer.enqueue(FULL_LINES, job="full")

    async def chunks(keys_of: Settings) -> dict[str, Chunk]:
        found: dict[str, Chunk] = {}
        for stream in (keys_of.keys.ingest, keys_of.keys.ingest_for("acme")):
            found |= {chunk.id: chunk for chunk in await _stream_chunks(client, stream)}
        return found

    from_file, from_python = await chunks(settings), await chunks(python)
    assert set(from_file) == {line["id"] for line in FULL_LINES}
    assert from_file == from_python
    assert from_file["m1"].representations == ("dense", "sparse")
    assert from_file["m1"].max_active_dims == 5
    assert from_file["m2"].pair == "The giant panda is a bear."
    assert from_file["m3"].multivector_dtype == "int8"


async def test_a_line_over_the_cap_is_a_bad_line_not_a_200_mb_read(
    settings: Settings, client: aioredis.Redis, tmp_path: Path
) -> None:
    """The smaller point: a 200 MB line was read whole (474 MB RSS). A line longer than the
    JSON of the largest message (6 x EMBEDFLEET_MAX_MESSAGE_BYTES: JSON spells a byte in 6 at
    most) is a bad line named with its number, the lines after it are read, and the CLI's peak
    RSS grows by about the cap, not the line. Scaled down: a 120 MB line with the default 4 MiB
    message cap (a 24 MiB line cap), against the same CLI's peak on a two-line file."""
    small = tmp_path / "small.jsonl"
    small.write_bytes(b'{"id": "s1", "text": "first"}\n{"id": "s2", "text": "last"}\n')
    source = tmp_path / "huge.jsonl"
    with source.open("wb") as handle:
        handle.write(b'{"id": "before", "text": "first"}\n{"id": "huge", "text": "')
        block = b"x" * (1 << 20)
        for _ in range(120):
            handle.write(block)
        handle.write(b'"}\n{"id": "after", "text": "last"}\n')
    env = cli_env(settings)
    _, baseline_mb = await asyncio.to_thread(_peak_rss_mb, "enqueue", str(small), env=env)
    result, peak_mb = await asyncio.to_thread(
        _peak_rss_mb, "enqueue", str(source), "--job", "huge", env=env
    )
    ids = {chunk.id for chunk in await _stream_chunks(client, settings.keys.ingest)}
    print(
        f"exit {result.returncode}, ids {sorted(ids - {'s1', 's2'})}, the CLI's peak RSS "
        f"{peak_mb:.0f} MB (on two short lines: {baseline_mb:.0f} MB); stderr tail "
        f"{result.stderr[-300:]!r}"
    )
    assert TRACEBACK not in result.stderr
    assert result.returncode == ExitCode.REJECTED_LINES
    assert "line 2: longer than " in result.stderr
    assert ids - {"s1", "s2"} == {"before", "after"}
    assert peak_mb - baseline_mb < 64, f"{peak_mb - baseline_mb:.0f} MB more for a 120 MB line"


def _peak_rss_mb(*args: str, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], float]:
    """`embedfleet ARGS` run by a fresh interpreter that reports its one child's peak RSS
    (ru_maxrss of the waited children: this test process has other children, a worker's
    peak among them)."""
    report = (
        "import resource, subprocess, sys\n"
        "code = subprocess.run(sys.argv[1:]).returncode\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", report, *CLI, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    *stderr, peak_kb = result.stderr.rstrip("\n").split("\n")
    result.stderr = "\n".join(stderr)
    return result, int(peak_kb) / 1024


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass(frozen=True)
class Case:
    """One verb on one bad input, and the exit status the README's table documents for it."""

    verb: str  # the verb's path: "enqueue", "dead show", "migrate start"
    args: tuple[str | bytes, ...]
    expected: ExitCode
    why: str  # the bad input, for the failure's message
    # "live": the test's Redis; "dead": a closed port; "sink", "dead sink": with the LanceDB
    # sink of a dense table; "no table": a LanceDB sink whose table does not exist
    env: str = "live"


def _verbs(group: click.Group, prefix: str = "") -> set[str]:
    """Every verb `embedfleet --help` lists, and the subcommands of its groups."""
    found: set[str] = set()
    for name, command in group.commands.items():
        path = f"{prefix}{name}"
        if isinstance(command, click.Group):
            found |= _verbs(command, f"{path} ")
        else:
            found.add(path)
    return found


def _cases(files: dict[str, Path], busy_port: int) -> list[Case]:
    missing, empty, garbage, latin1, garbage_text = (
        str(files[name]) for name in ("missing", "empty", "garbage", "latin1", "garbage text")
    )
    usage, error, rejected = ExitCode.USAGE, ExitCode.ERROR, ExitCode.REJECTED_LINES
    dead = {"env": "dead"}
    table = ("--table", "dense")
    plan = ("--workers", "1", "--chunks", "1e6", "--texts-per-second-per-worker", "100")
    return [
        Case("calibration", (), error, "a dead Redis", **dead),
        Case("dead list", (), error, "a dead Redis", **dead),
        Case("dead show", ("1-0",), error, "an unknown dead letter"),
        Case("dead show", ("1-0",), error, "a dead Redis", **dead),
        Case("dead replay", (), error, "a dead Redis", **dead),
        Case("dead purge", ("--yes",), error, "a dead Redis", **dead),
        Case("demo", ("--corpus", missing), usage, "a missing file"),
        Case("enqueue", (missing,), usage, "a missing file"),
        Case("enqueue", (empty,), rejected, "a line with empty text"),
        Case("enqueue", (garbage,), rejected, "binary garbage"),
        Case("enqueue", (latin1,), rejected, "invalid UTF-8"),
        Case("enqueue", (empty,), error, "a dead Redis", **dead),
        Case("enqueue", ("--documents", missing), usage, "a missing document"),
        Case("enqueue", ("--documents", garbage_text), rejected, "a document of binary garbage"),
        Case("enqueue", ("--documents", latin1), rejected, "a document line not UTF-8"),
        Case("index", (), error, "the Redis sink (no table to index)"),
        Case("index", (), error, "a table that does not exist", env="no table"),
        Case("migrate canary", (*table, "--queries", missing), usage, "a missing file"),
        Case("migrate finish", table, error, "a dead Redis", env="dead sink"),
        Case("migrate rollback", table, error, "a dead Redis", env="dead sink"),
        Case("migrate start", (*table, "--to-lane", "b"), error, "a dead Redis", env="dead sink"),
        Case("migrate status", table, error, "a dead Redis", env="dead sink"),
        Case("migrate switch", table, error, "a dead Redis", env="dead sink"),
        Case("plan", (*plan, "--figures", missing), usage, "a missing file"),
        Case("plan", (*plan, "--figures", garbage), usage, "binary garbage"),
        Case("plan", (*plan, "--measure"), error, "a dead Redis", **dead),
        Case("prune", ("--job", "j", "--keep", missing), usage, "a missing file", env="sink"),
        # an id it cannot read would be a row deleted: the whole prune is refused
        Case("prune", ("--job", "j", "--keep", garbage), error, "binary garbage", env="sink"),
        Case("query", ("",), usage, "empty text"),
        Case("query", (b"caf\xe9",), usage, "invalid UTF-8"),
        Case("query", ("hello", "--timeout", "5"), error, "a dead Redis", **dead),
        Case("results", ("--out", files["out"].as_posix()), error, "a dead Redis", **dead),
        Case("search", ("",), usage, "empty text", env="sink"),
        Case("search", (b"caf\xe9",), usage, "invalid UTF-8", env="sink"),
        Case("search", ("hello", "--hybrid"), error, "a dense table", env="sink"),
        Case("search", ("hello", "--timeout", "5"), error, "a dead Redis", env="dead sink"),
        Case("serve", ("--port", str(busy_port)), error, "a port already taken"),
        Case("status", (), error, "a dead Redis", **dead),
        # a dead Redis is an outage the worker waits out (the design): its bad input is a model
        Case("worker", ("--model", missing), error, "a missing model directory"),
    ]


async def test_every_verb_on_bad_input_exits_with_its_status_and_no_traceback(
    workers: WorkerLauncher,
    settings: Settings,
    client: aioredis.Redis,
    tmp_path: Path,
) -> None:
    """Every verb (`embedfleet --help`, the groups' subcommands too) on bad input: a missing
    file, empty text, binary garbage, invalid UTF-8 (in a file and in argv), a dead Redis (a
    closed port, EMBEDFLEET_REDIS_CONNECT_S=2), a table of the wrong kind (`search --hybrid` on
    a dense LanceDB table, with a real worker of the dense model answering). Each ends with
    the exit status shared/exit_codes.py documents and a message, never a traceback."""
    from embedfleet.cli import main
    from embedfleet.shared.protocol import Result
    from embedfleet.sinks import open_backend, parse_sink_url

    # its model card and answers, for query and search (eager: see EAGER)
    worker = workers.process("dense", EMBEDFLEET_FROZEN_QUERIES="false")
    files = {
        "missing": tmp_path / "no-such-file.jsonl",
        "empty": tmp_path / "empty-text.jsonl",
        "garbage": tmp_path / "garbage.bin",
        "latin1": tmp_path / "latin1.jsonl",
        "garbage text": tmp_path / "garbage.txt",
        "out": tmp_path / "out.jsonl",
    }
    # the empty string: whitespace-only text is text since the protocol follows TEI (0d1f650)
    files["empty"].write_text('{"id": "e", "text": ""}\n')
    files["garbage"].write_bytes(bytes(range(256)) * 64)
    files["garbage text"].write_bytes(bytes(range(256)) * 64)
    files["latin1"].write_bytes(b'{"id": "l", "text": "caf\xe9"}\n')
    lance = tmp_path / "lance"
    dense = open_backend(parse_sink_url(f"lancedb://{lance}", "dense"))
    dense.setup("all-MiniLM-L6-v2", 384)
    vector = np.full(384, 384**-0.5, dtype=np.float16)
    dense.upsert([Result(id="r1", model="all-MiniLM-L6-v2", vector=vector, text="stored")])
    dense.close()
    live = cli_env(settings, EMBEDFLEET_LOG_FORMAT="json")
    sink = {"EMBEDFLEET_SINK": f"lancedb://{lance}", "EMBEDFLEET_SINK_TABLE": "dense"}
    environments = {
        "live": live,
        "sink": live | sink,
        "no table": {**live, "EMBEDFLEET_SINK": f"lancedb://{lance}"},
        "dead": {
            **live,
            "EMBEDFLEET_REDIS_URL": f"redis://127.0.0.1:{_closed_port()}/0",
            "EMBEDFLEET_REDIS_CONNECT_S": "2",
            "EMBEDFLEET_REDIS_RETRY_S": "2",
        },
    }
    environments["dead sink"] = {**environments["dead"], **sink}
    await until(lambda: _card_published(client, settings), timeout=300)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cases = _cases(files, busy.getsockname()[1])
        assert {case.verb for case in cases} == _verbs(main), "a verb without a bad-input case"
        # the cases are independent, and most of each is waiting (an interpreter's start, a
        # dead Redis's connect timeout): a few at a time
        at_once = asyncio.Semaphore(4)

        async def failure(case: Case) -> str | None:
            async with at_once:
                try:
                    result = await asyncio.to_thread(
                        embedfleet,
                        *case.verb.split(),
                        *case.args,
                        env=environments[case.env],
                        timeout=180,
                    )
                except subprocess.TimeoutExpired:
                    return f"{case.verb} {case.why}: still running after 180 s"
            said = f"{case.verb} {case.why}: exit {result.returncode}"
            print(said)
            if TRACEBACK in result.stderr or result.returncode != case.expected:
                return (
                    f"{said}, expected {case.expected.value} ({case.expected.name}); stderr "
                    f"tail: {result.stderr[-400:]!r}"
                )
            return None

        failures = [f for f in await asyncio.gather(*map(failure, cases)) if f is not None]
    assert worker.poll() is None, worker.log()
    assert not failures, "\n".join(failures)
