"""Issue 40, point 2 and part of point 9: a consuming export killed and run again loses nothing;
`results --model`; `status --json` reports every lane's usage.

Against a real redis-server (tests/conftest.py) and real `embedfleet results` processes. The
results are written straight onto the results stream in the Redis sink's format
(``encode_result``, as tests/end_to_end/test_drain.py does), so no worker or model runs: what is
under test
is the reader and the file, not the embedding.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aioredis

from embedfleet.shared.keys import USAGE_SEPARATOR
from embedfleet.shared.model_registry import register_model
from embedfleet.shared.protocol import PAYLOAD_FIELD, Result, encode_result
from embedfleet.shared.settings import Settings
from tests.conftest import cli_env, start_cli, until

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
pytestmark = pytest.mark.slow

RESULTS = 20_000  # the figure
DIM = 384  # all-MiniLM-L6-v2's: a .jsonl line of the real size (~4 KB)
PAGE = 250


async def write_results(
    client: aioredis.Redis, stream: str, ids: list[str], dim: int = DIM, model: str = "m"
) -> None:
    """The results straight onto a results stream, as the Redis sink writes them."""
    for start in range(0, len(ids), 1000):
        pipe = client.pipeline(transaction=False)
        for index, chunk_id in enumerate(ids[start : start + 1000], start):
            vector = np.full(dim, index % 1000, np.float16)
            result = Result(id=chunk_id, model=model, vector=vector, job="j")
            pipe.xadd(stream, {PAYLOAD_FIELD: encode_result(result)})
        await pipe.execute()


def jsonl_ids(out: Path) -> list[str]:
    """The ids of a .jsonl export; fails on a torn (partial, unparsable) line."""
    data = out.read_bytes()
    assert not data or data.endswith(b"\n"), f"torn last line: ...{data[-80:]!r}"
    return [json.loads(line)["id"] for line in data.splitlines()]


async def run_to_end(env: dict[str, str], args: Sequence[str]) -> tuple[dict[str, Any], bytes]:
    """`embedfleet` with ``args`` run to its end: its --json report and its stderr."""
    again = await start_cli(env, *args)
    stdout, stderr = await asyncio.wait_for(again.communicate(), timeout=300)
    assert again.returncode == 0, stderr.decode(errors="replace")
    return json.loads(stdout), stderr


def exported(out: Path) -> tuple[list[str], np.ndarray | None]:
    """The ids an export wrote, in file order, and its vectors (.npz; None for .jsonl)."""
    if out.suffix == ".npz":
        with np.load(out) as archive:
            return list(archive["ids"]), archive["vectors"]
    return jsonl_ids(out), None


@pytest.mark.parametrize("suffix", [".jsonl", ".npz"])
async def test_a_consuming_export_killed_and_run_again_loses_nothing(
    settings: Settings, client: aioredis.Redis, tmp_path: Path, suffix: str
) -> None:
    """20,000 results; `results --consume --out FILE` SIGKILLed while it writes a page after
    four acknowledged ones (the stream shrank, then the file grew), then run again with the
    same command: every id is in FILE once (a page written but not yet acknowledged at the
    kill comes again, and replaces its copy), the stream is empty, and FILE holds only whole
    lines (a tail torn by a kill inside the page's write is cut by the re-run).

    The re-run takes back the page the killed run held at once (the export's reader is named
    after its file); the claim idle is shortened to 5 s only so that a reader without that
    (today's code) still finishes, by claiming it."""
    stream = settings.keys.results
    ids = [f"r{i}" for i in range(RESULTS)]
    await write_results(client, stream, ids)
    out = tmp_path / f"drained{suffix}"
    env = cli_env(settings, EMBEDFLEET_RESULTS_CLAIM_IDLE_MS="5000")
    args = ("results", "--out", str(out), "--consume", "--page", str(PAGE), "--json")

    killed = await start_cli(env, *args)

    # the file the export is writing (an .npz's pages go to its .part files first)
    growing = out if suffix == ".jsonl" else Path(f"{out}.vectors.part")
    size_then = 0

    async def some_pages_acknowledged() -> bool:
        nonlocal size_then
        assert killed.returncode is None, "the export finished before it could be killed"
        size_then = growing.stat().st_size if growing.exists() else 0
        return await client.xlen(stream) <= RESULTS - 4 * PAGE

    async def next_page_being_written() -> bool:
        assert killed.returncode is None, "the export finished before it could be killed"
        return growing.stat().st_size > size_then

    # killed while it writes the page after four acknowledged ones
    await until(some_pages_acknowledged, timeout=180)
    await until(next_page_being_written, timeout=180)
    killed.send_signal(signal.SIGKILL)
    await killed.wait()
    left = await client.xlen(stream)
    assert 0 < left < RESULTS, "the kill came mid-run"
    # the page it was writing, read and not acknowledged (none if killed between two pages)
    held = (await client.xpending(stream, "results-readers"))["pending"]
    if suffix == ".jsonl":
        # Whole lines, every one parsing: the pages acknowledged, and of the page in hand at
        # most what reached the file. Only a kill inside the page's one write(2) can tear its
        # last line (Linux returns a short write on a fatal signal): the re-run cuts it.
        data = out.read_bytes()
        whole, _, torn = data.rpartition(b"\n")
        taken_before = [json.loads(line)["id"] for line in whole.splitlines()]
        assert len(taken_before) >= RESULTS - left - PAGE
        print(f"killed: {len(taken_before)} whole lines, torn tail of {len(torn)} bytes")

    report, stderr = await run_to_end(env, args)
    got, vectors = exported(out)
    if vectors is not None:
        assert vectors.shape == (len(got), DIM)
        assert not list(tmp_path.glob("*.part")), "the .part files were assembled and removed"
    lost = set(ids) - set(got)
    print(f"{suffix}: {len(lost)} of {RESULTS} lost after a kill and a re-run; report {report}")
    assert not lost, f"{len(lost)} of {RESULTS} results in neither Redis nor {out.name}"
    assert await client.xlen(stream) == 0
    copies = Counter(got)
    assert set(copies) == set(ids)
    # once: the page in hand at the kill, if written, is cut back and written again (issue 54)
    assert sum(n - 1 for n in copies.values()) == 0
    assert report["vectors"] + report["earlier"] == len(got)
    groups = await client.xinfo_groups(stream)
    assert [g["pending"] for g in groups] == [0]
    # the page the killed run held was taken back at once, not claimed after the idle time
    assert b"claimed results a stopped reader held" not in stderr
    if held:
        assert b"took back results this reader held" in stderr, stderr.decode(errors="replace")


# `embedfleet results ...` in a process SIGKILLed at its KILL_AT_ACK-th acknowledgement: the
# page is written and fsynced, not yet acknowledged (the window a kill lands in at random)
KILLED_BEFORE_ACK = textwrap.dedent(
    """
    import os, signal, sys

    from embedfleet.cli import main
    from embedfleet.producer.results_reader import ResultsReader

    kill_at, calls = int(os.environ["KILL_AT_ACK"]), 0
    acknowledge = ResultsReader.acknowledge

    async def acknowledge_or_die(self, page):
        global calls
        calls += 1
        if calls == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        await acknowledge(self, page)

    ResultsReader.acknowledge = acknowledge_or_die
    sys.argv = ["embedfleet", *sys.argv[1:]]
    main()
    """
)


@pytest.mark.parametrize("suffix", [".npz", ".jsonl"])
async def test_a_consuming_export_killed_twice_between_write_and_ack_holds_each_id_once(
    settings: Settings, client: aioredis.Redis, tmp_path: Path, suffix: str
) -> None:
    """Issue 54: killed twice after a page was written and before it was acknowledged, then run
    to its end, the export holds each id once (a .npz held the two pages twice: 20,200 rows for
    20,000 ids). The re-run takes the killed run's page back; the file already holds it."""
    stream = settings.keys.results
    results, page = 3000, 250
    ids = [f"r{i}" for i in range(results)]
    await write_results(client, stream, ids)
    out = tmp_path / f"twice{suffix}"
    args = ("results", "--out", str(out), "--consume", "--page", str(page), "--json")
    for kill_at in (5, 3):  # the 5th page of the first run, the 3rd of the second
        env = cli_env(settings, KILL_AT_ACK=str(kill_at))
        killed = await asyncio.create_subprocess_exec(
            sys.executable, "-c", KILLED_BEFORE_ACK, *args, env=env, stderr=subprocess.PIPE
        )
        _, stderr = await asyncio.wait_for(killed.communicate(), timeout=300)
        assert killed.returncode == -signal.SIGKILL, stderr.decode(errors="replace")
        assert (await client.xpending(stream, "results-readers"))["pending"] == page
    report, _ = await run_to_end(cli_env(settings), args)
    got, vectors = exported(out)
    if vectors is not None:
        # each row's vector is its own (write_results: the index mod 1000)
        assert vectors[:, 0].tolist() == [int(i[1:]) % 1000 for i in got]
    twice = sorted(chunk_id for chunk_id, n in Counter(got).items() if n > 1)
    assert (len(got), twice[:5]) == (results, []), f"{len(twice)} ids twice"
    assert sorted(got) == sorted(ids)
    assert report["vectors"] + report["earlier"] == results
    assert await client.xlen(stream) == 0
    assert not list(tmp_path.glob("*.part")) and not list(tmp_path.glob("*.page"))


async def test_results_model_drains_that_lanes_stream_only(
    settings: Settings, client: aioredis.Redis, tmp_path: Path
) -> None:
    """`results --model LANE --consume` reads LANE's results stream, as `enqueue --model` and
    `query --model` pick its lane; the default model's stream stays as it was. An unknown
    model ends with the message, exit 1."""
    lane = settings.keys.for_model("tiny-lane")
    await register_model(client, lane, "tiny-lane", None)
    await write_results(client, lane.results, [f"lane{i}" for i in range(300)], dim=16)
    await write_results(client, settings.keys.results, [f"default{i}" for i in range(200)])
    out = tmp_path / "lane.jsonl"
    env = cli_env(settings)
    ran = await start_cli(
        env, "results", "--model", "tiny-lane", "--out", str(out), "--consume", "--json"
    )
    stdout, stderr = await asyncio.wait_for(ran.communicate(), timeout=120)
    assert ran.returncode == 0, stderr.decode(errors="replace")
    assert json.loads(stdout)["source"] == f"the results stream {lane.results}"
    assert sorted(jsonl_ids(out)) == sorted(f"lane{i}" for i in range(300))
    assert await client.xlen(lane.results) == 0
    assert await client.xlen(settings.keys.results) == 200
    unknown = await start_cli(env, "results", "--model", "nope", "--out", str(tmp_path / "x.jsonl"))
    _, stderr = await asyncio.wait_for(unknown.communicate(), timeout=120)
    assert unknown.returncode == 1 and b"'nope' is not served" in stderr, stderr


async def test_status_json_reports_the_usage_of_every_lane(
    settings: Settings, client: aioredis.Redis
) -> None:
    """Two lanes, each with usage on its own usage hash (``Keys.usage``, the fields the ack
    script writes: ``<counter>|<tenant>|<model>|<job>``): `status --json` lists both, whatever
    EMBEDFLEET_MODEL_LANE says."""
    lane = settings.keys.for_model("tiny-lane")
    await register_model(client, settings.keys, "default-model", None)
    await register_model(client, lane, "tiny-lane", None)
    for keys, model, chunks in ((settings.keys, "default-model", 7), (lane, "tiny-lane", 5)):
        fields = {"chunks": chunks, "tokens": chunks * 10, "model_us": chunks * 1000}
        for counter, value in fields.items():
            field = USAGE_SEPARATOR.join((counter, "", model, "job-a"))
            await client.hincrby(keys.usage, field, value)
    for extra in ({}, {"EMBEDFLEET_MODEL_LANE": "tiny-lane"}):
        ran = await start_cli(cli_env(settings, **extra), "status", "--json", "--sample", "0")
        stdout, stderr = await asyncio.wait_for(ran.communicate(), timeout=120)
        assert ran.returncode == 0, stderr.decode(errors="replace")
        usage = {(u["model"], u["job"]): u["chunks"] for u in json.loads(stdout)["usage"]}
        assert usage == {("default-model", "job-a"): 7, ("tiny-lane", "job-a"): 5}, extra


KILLED_MID_PAGE = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path

    import numpy as np

    from embedfleet.ops.export import ExportWriter
    from embedfleet.shared.protocol import Result

    def rows(first, count, kill_at=None):
        for i in range(first, first + count):
            if i == kill_at:  # SIGKILL while the page is being formatted and written
                os.kill(os.getpid(), signal.SIGKILL)
            yield Result(id=f"r{i}", model="m", vector=np.full(384, i % 1000, np.float16))

    writer = ExportWriter(Path(sys.argv[1]))
    writer.write(rows(0, 100), durable=True)  # acknowledged next
    writer.write(rows(100, 100, kill_at=150), durable=True)
    """
)


def test_a_kill_while_a_page_is_formatted_leaves_the_file_at_its_last_page(
    tmp_path: Path,
) -> None:
    """The export SIGKILLed half way through formatting a page (Python's buffer used to send it
    to the file in 8 KiB pieces as it was formatted): the .jsonl holds the pages before, whole,
    and nothing of the page in hand (what the docs promise: whole up to its last page)."""
    out = tmp_path / "killed.jsonl"
    ran = subprocess.run([sys.executable, "-c", KILLED_MID_PAGE, str(out)], check=False)
    assert ran.returncode == -signal.SIGKILL
    assert jsonl_ids(out) == [f"r{i}" for i in range(100)]


def page(first: int, count: int, dim: int = 8) -> list[Result]:
    return [
        Result(id=f"r{i}", model="m", vector=np.full(dim, i, np.float16))
        for i in range(first, first + count)
    ]


def test_a_consuming_jsonl_export_adds_to_the_file_and_cuts_a_torn_tail(tmp_path: Path) -> None:
    """Resumed (a consuming export), a .jsonl keeps its whole lines, loses the torn one the
    killed run left (that page was not acknowledged: it comes again), and is appended to; a
    run that takes nothing leaves the file as it was. Without resume it is written afresh."""
    from embedfleet.ops.export import ExportWriter

    out = tmp_path / "out.jsonl"
    with ExportWriter(out, resume=True) as writer:
        writer.write(page(0, 3), durable=True)
    with out.open("a") as torn:
        torn.write('{"id": "r3", "vec')
    with ExportWriter(out, resume=True) as writer:
        assert writer.earlier == 3
        writer.write(page(3, 2), durable=True)
    assert (writer.count, writer.total) == (2, 5)
    assert jsonl_ids(out) == [f"r{i}" for i in range(5)]
    with pytest.raises(ConnectionError), ExportWriter(out, resume=True):
        raise ConnectionError("Redis away before any page")
    assert jsonl_ids(out) == [f"r{i}" for i in range(5)]
    with ExportWriter(out) as writer:
        writer.write(page(7, 1))
    assert jsonl_ids(out) == ["r7"]


def test_a_consuming_npz_export_takes_up_a_killed_runs_parts(tmp_path: Path) -> None:
    """A killed run's .part files are taken up by the next consuming run (their whole rows:
    a torn page is cut) and the archive holds both runs'; a finished archive is never replaced
    by a consuming run, and a plain export refuses to destroy the parts."""
    from embedfleet.ops.export import ExportFileError, ExportWriter

    out = tmp_path / "out.npz"
    killed = ExportWriter(out, resume=True)
    killed.write(page(0, 4), durable=True)
    killed.write(page(4, 2), durable=True)
    os.close(killed._ids_fd)  # the process dies: its lock goes with it
    os.close(killed._vectors_fd)
    # the kill came while the third page was written: its vectors whole, one id of two
    with open(f"{out}.vectors.part", "ab") as vectors:
        vectors.write(np.full(8, 9, np.float16).tobytes() * 2)
    with open(f"{out}.ids.part", "ab") as ids:
        ids.write(b'"r6"\n"r')
    with pytest.raises(ExportFileError, match="unfinished export"):
        ExportWriter(out)
    with ExportWriter(out, resume=True) as writer:
        assert writer.earlier == 7  # r6's vector and id line were whole
        writer.write(page(6, 3), durable=True)  # the page again, and one more
    with np.load(out) as archive:
        assert list(archive["ids"]) == [f"r{i}" for i in (*range(7), 6, 7, 8)]
        assert archive["vectors"][:, 0].tolist() == [*range(6), 9, 6, 7, 8]
    assert not list(tmp_path.glob("*.part"))
    with pytest.raises(ExportFileError, match="cannot be added to"):
        ExportWriter(out, resume=True)
    assert not list(tmp_path.glob("*.part"))


def test_two_exports_to_one_file_are_refused(tmp_path: Path) -> None:
    from embedfleet.ops.export import ExportFileError, ExportWriter

    for suffix in (".jsonl", ".npz"):
        out = tmp_path / f"busy{suffix}"
        with ExportWriter(out, resume=True) as first:
            first.write(page(0, 1), durable=True)
            with pytest.raises(ExportFileError, match="another export is writing"):
                ExportWriter(out, resume=True)


def test_a_failed_jsonl_export_keeps_its_page_mark_for_the_next_run(tmp_path: Path) -> None:
    """Redis away before the last page's acknowledgement: the export ends with what it wrote and
    keeps that page's mark, so the next run, which takes the page back, writes it once; a page
    of other entries (or another partition's stream) is never cut back."""
    from embedfleet.ops.export import ExportWriter

    out, mark = tmp_path / "out.jsonl", tmp_path / "out.jsonl.page"
    with pytest.raises(ConnectionError), ExportWriter(out, resume=True) as writer:
        writer.write(page(0, 3), durable=True, entries=("s", [b"1-0", b"1-1", b"1-2"]))
        writer.write(page(3, 2), durable=True, entries=("s", [b"2-0", b"2-1"]))
        raise ConnectionError("Redis away before the second page's XACK")
    assert mark.exists()
    with ExportWriter(out, resume=True) as writer:
        writer.write(page(3, 2), durable=True, entries=("s", [b"2-0", b"2-1"]))  # taken back
        assert writer.earlier == 3
        writer.write(page(5, 1), durable=True, entries=("s", [b"3-0"]))
    assert jsonl_ids(out) == [f"r{i}" for i in range(6)]
    assert not mark.exists()
    with pytest.raises(ConnectionError), ExportWriter(out, resume=True) as writer:
        writer.write(page(6, 1), durable=True, entries=("s", [b"4-0"]))
        raise ConnectionError("Redis away")
    with ExportWriter(out, resume=True) as writer:  # the same entry id on another stream
        writer.write(page(7, 1), durable=True, entries=("s:p1", [b"4-0"]))
    assert jsonl_ids(out) == [f"r{i}" for i in range(8)]
