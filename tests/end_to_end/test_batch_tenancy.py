"""The Batch API's owners, limits and leases, with the real `openai` SDK against running
gateways, a real worker process and a real Redis server:

- every object (file, batch, output file) belongs to the API key that made it: another key gets
  a 404 for each of them, as for a missing one;
- an owner over its limit of active batches gets a 429; a line or file over its cap a 400, with
  nothing stored or queued;
- a batch finalized by two gateway replicas (a short lease, the first replica's finalize held
  on an event) is ended once, with one output file: the lease is renewed while the step runs,
  and a replica that lost it publishes nothing.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import openai
import pytest
import redis

from embedfleet.gateway.batch.files import bounded_lines
from embedfleet.gateway.batch.lease import BatchLeases
from embedfleet.gateway.batch.output import BatchOutput
from embedfleet.gateway.batch.runner import BatchRunner
from embedfleet.shared.settings import Settings
from tests.conftest import WorkerProcess
from tests.gateway_support import (
    module_fleet_settings,
    module_worker,
    running_gateway,
    wait_for_worker,
)
from tests.integration.gateway.batch.test_api import (
    batch_line,
    create_batch,
    jsonl,
    upload,
    wait_final,
    wait_until,
)

# the slow tier (make test-full, CI): starts a worker process and gateways
pytestmark = pytest.mark.slow

KEY_A, KEY_B = "key-of-tenant-a", "key-of-tenant-b"


fleet_settings = module_fleet_settings("bt", api_keys=f"{KEY_A},{KEY_B}")


worker = module_worker("bt")


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


@pytest.fixture
def gateway_url(fleet_settings: Settings, worker: WorkerProcess) -> Iterator[str]:
    with running_gateway(fleet_settings) as url:
        wait_for_worker(url)
        yield url


def test_a_key_gets_404_for_every_object_of_another_key(gateway_url: str, tmp_path: Path) -> None:
    a, b = client(gateway_url, KEY_A), client(gateway_url, KEY_B)
    lines = [batch_line(f"a{n}", f"tenant a text {n}") for n in range(3)]
    a_file = upload(a, tmp_path / "a.jsonl", lines)
    a_batch = wait_final(a, create_batch(a, a_file.id).id)
    assert a_batch.status == "completed" and a_batch.output_file_id
    a_output = a_batch.output_file_id
    b_file = upload(b, tmp_path / "b.jsonl", [batch_line("b0", "tenant b text")])

    # lists: each key sees its own only
    assert {f.id for f in a.files.list()} == {a_file.id, a_output}
    assert {f.id for f in b.files.list()} == {b_file.id}
    assert [x.id for x in a.batches.list()] == [a_batch.id]
    assert list(b.batches.list()) == []
    # every route on another key's object: 404, as for an object that does not exist
    attempts: dict[str, Any] = {
        "files.retrieve(input)": lambda: b.files.retrieve(a_file.id),
        "files.retrieve(output)": lambda: b.files.retrieve(a_output),
        "files.content(input)": lambda: b.files.content(a_file.id),
        "files.content(output)": lambda: b.files.content(a_output),
        "files.delete(input)": lambda: b.files.delete(a_file.id),
        "files.delete(output)": lambda: b.files.delete(a_output),
        "batches.retrieve": lambda: b.batches.retrieve(a_batch.id),
        "batches.cancel": lambda: b.batches.cancel(a_batch.id),
        "batches.create(a's file)": lambda: create_batch(b, a_file.id),
        "files.retrieve(b's, by a)": lambda: a.files.retrieve(b_file.id),
    }
    answers = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            answers[name] = 200
        except openai.APIStatusError as error:
            answers[name] = error.status_code
    assert answers == dict.fromkeys(attempts, 404)
    # and nothing of a's changed: b's delete did not delete
    assert a.files.retrieve(a_file.id).id == a_file.id
    assert len(jsonl(a, a_output)) == 3
    assert list(b.batches.list()) == [] and len(list(a.batches.list())) == 1


def test_an_owner_over_its_limit_of_active_batches_gets_429(
    fleet_settings: Settings, worker: WorkerProcess, tmp_path: Path
) -> None:
    with running_gateway(
        fleet_settings.model_copy(update={"batch_max_active_per_owner": 1})
    ) as url:
        wait_for_worker(url)
        a, b = client(url, KEY_A), client(url, KEY_B)
        a_file = upload(a, tmp_path / "a.jsonl", [batch_line("a", "one")])
        b_file = upload(b, tmp_path / "b.jsonl", [batch_line("b", "two")])
        # the worker stopped: a's first batch stays active while the others are asked for
        worker.send_signal(signal.SIGSTOP)
        try:
            first = create_batch(a, a_file.id)
            with pytest.raises(openai.RateLimitError) as refused:
                create_batch(a, a_file.id)
            others = create_batch(b, b_file.id)  # b's limit is its own
        finally:
            worker.send_signal(signal.SIGCONT)
        body = refused.value.body
        assert isinstance(body, dict) and body["code"] == "too_many_active_batches"
        assert "EMBEDFLEET_BATCH_MAX_ACTIVE_PER_OWNER" in body["message"]
        assert body["type"] == "rate_limit_error"
        # the refused one was not recorded
        assert [x.id for x in a.batches.list() if x.input_file_id == a_file.id] == [first.id]
        assert wait_final(a, first.id).status == "completed"
        assert wait_final(b, others.id).status == "completed"
        # once the first ended, a may run another
        assert wait_final(a, create_batch(a, a_file.id).id).status == "completed"


def test_a_line_or_file_over_its_cap_is_a_400_and_nothing_is_stored_or_queued(
    fleet_settings: Settings, worker: WorkerProcess, tmp_path: Path, server: redis.Redis
) -> None:
    caps = {"batch_max_line_bytes": 2048, "batch_max_file_bytes": 64 * 1024}
    files_dir = Path(fleet_settings.files_dir)
    ingest = [keys.ingest for keys in fleet_settings.keys.partitions_keys]
    with running_gateway(fleet_settings.model_copy(update=caps)) as url:
        a = client(url, KEY_A)
        before = sorted(files_dir.iterdir())
        queued = [server.xlen(key) for key in ingest]
        long_line = batch_line("long", "x" * 3000)  # one valid request, over the line cap
        with pytest.raises(openai.BadRequestError) as line_refused:
            upload(a, tmp_path / "line.jsonl", [batch_line("short", "fine"), long_line])
        # over the file cap, but not so far over that the front door refuses the body unread
        many = [batch_line(f"r{n}", f"text {n}") for n in range(700)]
        assert 64 * 1024 < len("\n".join(many)) < 128 * 1024
        with pytest.raises(openai.BadRequestError) as file_refused:
            upload(a, tmp_path / "file.jsonl", many)
        within = upload(a, tmp_path / "ok.jsonl", [batch_line("ok", "y" * 1900)])
        listed = {f.filename for f in a.files.list()}
    line_body, file_body = line_refused.value.body, file_refused.value.body
    assert isinstance(line_body, dict) and isinstance(file_body, dict)
    assert line_body["code"] == "line_too_large" and line_body["param"] == "file"
    assert "line 2 " in line_body["message"]
    assert "EMBEDFLEET_BATCH_MAX_LINE_BYTES" in line_body["message"]
    assert file_body["code"] == "file_too_large"
    assert "EMBEDFLEET_BATCH_MAX_FILE_BYTES" in file_body["message"]
    assert "line.jsonl" not in listed and "file.jsonl" not in listed
    # nothing of the refused uploads is on disk (the accepted one is), nothing was queued
    after = sorted(set(files_dir.iterdir()) - set(before))
    assert sorted(p.name for p in after) == sorted([f"{within.id}.data", f"{within.id}.json"])
    assert [server.xlen(key) for key in ingest] == queued


def test_a_stored_line_over_a_lowered_cap_fails_its_batch_naming_the_line(
    fleet_settings: Settings, worker: WorkerProcess, tmp_path: Path
) -> None:
    """A file stored before the cap was lowered: validation names the line (read in bounded
    pieces, never whole) and fails the batch before anything is sent."""
    lines = [batch_line("short", "fine"), batch_line("long", "x" * 3000), batch_line("s2", "ok")]
    with running_gateway(fleet_settings) as url:
        stored = upload(client(url, KEY_A), tmp_path / "before.jsonl", lines)
    with running_gateway(fleet_settings.model_copy(update={"batch_max_line_bytes": 2048})) as url:
        wait_for_worker(url)
        a = client(url, KEY_A)
        batch = wait_final(a, create_batch(a, stored.id).id)
    assert batch.status == "failed" and batch.request_counts.total == 3
    [error] = batch.errors.data
    assert (error.code, error.line) == ("line_too_large", 2)
    assert "EMBEDFLEET_BATCH_MAX_LINE_BYTES" in error.message


def test_bounded_lines_never_holds_a_line_over_the_cap(tmp_path: Path) -> None:
    path = tmp_path / "lines"
    path.write_bytes(b"short\n" + b"x" * 10_000 + b"\n\n" + b"y" * 16 + b"\nend")
    with path.open("rb") as handle:
        assert list(bounded_lines(handle, 16)) == [
            b"short\n",
            None,
            b"\n",
            b"y" * 16 + b"\n",
            b"end",
        ]


class HeldFinalize:
    """The first finalize of a batch held inside its writing (on an event, in the worker thread
    it runs in), and the replicas' lease renewals and steps counted, to sync the test on them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.input_file_id: str | None = None  # the batch: the one made from this file
        self.holder: str | None = None  # the runner (instance) whose finalize is held
        self.writes = 0
        self.inside = threading.Event()
        self.release = threading.Event()
        self.released = False
        self.holder_done = threading.Event()
        self.renewals = 0
        self.renewed = threading.Event()
        self._lock = threading.Lock()
        write_files = BatchOutput._write_files

        def held_write(runner: BatchOutput, batch: dict, *args: Any) -> Any:
            with self._lock:
                self.writes += 1
                first = batch["input_file_id"] == self.input_file_id and self.holder is None
                if first:
                    self.holder = runner.instance
            if first:
                self.inside.set()
                assert self.release.wait(timeout=300), "the test never released the finalize"
            return write_files(runner, batch, *args)

        monkeypatch.setattr(BatchOutput, "_write_files", held_write)
        with_lease = BatchRunner._with_lease

        async def tracked_step(runner: BatchRunner, batch_id: str) -> None:
            await with_lease(runner, batch_id)
            if self.released and runner.instance == self.holder:
                self.holder_done.set()

        monkeypatch.setattr(BatchRunner, "_with_lease", tracked_step)
        # the renewals of the held replica (absent on code without renewal: never counted)
        still_ours = getattr(BatchLeases, "still_ours", None)

        async def counted(runner: BatchLeases, *args: Any) -> bool:
            assert still_ours is not None
            ours = await still_ours(runner, *args)
            if ours and runner.instance == self.holder and not self.release.is_set():
                self.renewals += 1
                if self.renewals >= 6:  # two whole lease lengths: a renewal every third
                    self.renewed.set()
            return ours

        monkeypatch.setattr(BatchLeases, "still_ours", counted, raising=False)

    def let_go(self) -> None:
        """Release the held finalize (marked released first: the holder's step reports its
        return only after that)."""
        self.released = True
        self.release.set()


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> HeldFinalize:
    return HeldFinalize(monkeypatch)


@pytest.fixture
def server(fleet_settings: Settings) -> Iterator[redis.Redis]:
    """A plain client of the fleet's Redis, to look at its keys."""
    with redis.Redis.from_url(fleet_settings.effective_redis_url) as connection:
        yield connection


LEASE_MS = 1000  # short: without renewal, another replica takes over within it

LEASE_TEXTS = 10


@contextlib.contextmanager
def two_replicas_one_finalize_held(
    fleet_settings: Settings, tmp_path: Path, held: HeldFinalize
) -> Iterator[tuple[openai.OpenAI, openai.OpenAI, str]]:
    """Two gateway replicas (clients of key a on each) and a batch whose first finalize is
    held; yields once it is, with the batch id. The finalize is let go on exit in any case."""
    replica = fleet_settings.model_copy(update={"batch_lease_ms": LEASE_MS})
    with running_gateway(replica) as first_url, running_gateway(replica) as second_url:
        wait_for_worker(first_url)
        a = client(first_url, KEY_A)
        lines = [batch_line(f"l{n}", f"lease text {n}") for n in range(LEASE_TEXTS)]
        input_file = upload(a, tmp_path / "lease.jsonl", lines)
        held.input_file_id = input_file.id
        batch = create_batch(a, input_file.id)
        try:
            assert held.inside.wait(timeout=300), "no replica finalized the batch"
            yield a, client(second_url, KEY_A), batch.id
        finally:
            held.let_go()


FinalizeRace = Callable[[], AbstractContextManager[tuple[openai.OpenAI, openai.OpenAI, str]]]


@pytest.fixture
def finalize_race(
    fleet_settings: Settings, worker: WorkerProcess, tmp_path: Path, held: HeldFinalize
) -> FinalizeRace:
    """``two_replicas_one_finalize_held`` on the fleet's settings, its worker running."""
    return functools.partial(two_replicas_one_finalize_held, fleet_settings, tmp_path, held)


def test_the_lease_is_renewed_while_a_finalize_runs(
    finalize_race: FinalizeRace, fleet_settings: Settings, held: HeldFinalize, server: redis.Redis
) -> None:
    with finalize_race() as (a, _, batch_id):
        lease_key = fleet_settings.keys.batch_lease(batch_id)
        token = server.get(lease_key)
        assert token is not None
        # the held replica keeps its lease over two lease lengths, and the other replica does
        # not finalize meanwhile
        assert held.renewed.wait(timeout=60), f"the lease was renewed {held.renewals} times"
        assert server.get(lease_key) == token
        assert a.batches.retrieve(batch_id).status == "finalizing" and held.writes == 1
        # let go: it ends the batch itself
        held.let_go()
        final = wait_final(a, batch_id)
    assert final.status == "completed" and held.writes == 1


def test_a_batch_finalized_by_two_replicas_has_one_output_file(
    finalize_race: FinalizeRace, fleet_settings: Settings, held: HeldFinalize, server: redis.Redis
) -> None:
    with finalize_race() as (a, b, batch_id):
        # the held replica loses its lease (as after a pause longer than it, or a Redis it
        # could not reach to renew it); the other replica takes the batch over and ends it
        server.delete(fleet_settings.keys.batch_lease(batch_id))
        ended = wait_until(b, batch_id, lambda x: x.status == "completed", timeout=120)
        # then the first replica's finalize goes on: it must publish and end nothing
        held.let_go()
        assert held.holder_done.wait(timeout=60), "the held replica's step did not return"
        final = a.batches.retrieve(batch_id)
        outputs = [f for f in a.files.list() if f.filename.startswith(batch_id)]
        records = jsonl(a, final.output_file_id)
    assert held.writes == 2  # each replica wrote once
    assert final.model_dump() == ended.model_dump()  # ended once, by the lease's holder
    assert [f.id for f in outputs] == [final.output_file_id]
    assert sorted(r["custom_id"] for r in records) == sorted(f"l{n}" for n in range(LEASE_TEXTS))
    assert final.request_counts.completed == LEASE_TEXTS
    assert list(Path(fleet_settings.files_dir).glob(".tmp-*")) == []
