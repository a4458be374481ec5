"""The Batch API and its files as OpenAI runs them, with the real `openai` SDK against a running
gateway, a real worker process and a real Redis server: file-list pages, file expiry, the caps,
the completion window, and one batch's fault kept to that batch.

Each test runs exactly one gateway (the settings it needs): every gateway's batch runner works on
every batch of the namespace, and the caps are checked by whichever runner validates."""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import redis

from embedfleet.gateway.batch.files import STALE_TEMP_S, FileStore
from embedfleet.server import ServerProcess, isolated_settings
from embedfleet.shared.settings import Settings
from tests.conftest import WorkerProcess
from tests.gateway_support import (
    Gateway,
    module_fleet_settings,
    module_gateway,
    module_worker,
    running_gateway,
)

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
# waits: it mostly waits on the batch runner's rounds (Makefile, test-full)
pytestmark = [pytest.mark.slow, pytest.mark.waits]

MODEL = "all-MiniLM-L6-v2"
FINAL = ("completed", "failed", "expired", "cancelled")


fleet_settings = module_fleet_settings("ba")


worker = module_worker("ba")


gateway = module_gateway()


def batch_line(custom_id: str, body_input: object, **extra: object) -> str:
    body = {"model": MODEL, "input": body_input, **extra}
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body}
    )


def upload(client: openai.OpenAI, path: Path, lines: list[str], **options: Any):
    path.write_text("\n".join(lines) + "\n")
    with path.open("rb") as handle:
        return client.files.create(file=handle, purpose="batch", **options)


def create_batch(client: openai.OpenAI, file_id: str, **options: Any):
    return client.batches.create(
        input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h", **options
    )


def wait_until(
    client: openai.OpenAI, batch_id: str, done: Callable[[Any], bool], timeout: float = 300
):
    """Poll the batch until ``done(batch)`` holds; its last state, or AssertionError."""
    deadline = time.monotonic() + timeout
    while not done(batch := client.batches.retrieve(batch_id)):
        assert time.monotonic() < deadline, f"{batch_id} still {batch.status}: {batch}"
        time.sleep(0.1)  # polling the gateway's state, not waiting blind
    return batch


def wait_final(client: openai.OpenAI, batch_id: str, timeout: float = 300):
    return wait_until(client, batch_id, lambda b: b.status in FINAL, timeout)


def jsonl(client: openai.OpenAI, file_id: str) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_files_list_iterates_every_page_to_its_end(
    redis_server: ServerProcess, tmp_path: Path
) -> None:
    # a namespace and files directory of its own: the list is exactly what this test uploaded
    settings = isolated_settings(redis_server.url, files_dir=str(tmp_path / "files"))
    with running_gateway(settings) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        uploaded = [
            upload(client, tmp_path / f"f{n}.jsonl", [batch_line(f"r{n}", "text")]).id
            for n in range(5)
        ]
        newest_first = list(reversed(uploaded))
        # the SDK's cursor pages: it stops when has_more is false
        assert [f.id for f in client.files.list(limit=2)] == newest_first
        assert [f.id for f in client.files.list(limit=2, order="asc")] == uploaded
        first = client.files.list(limit=2)
        assert first.has_more and [f.id for f in first.data] == newest_first[:2]
        assert first.model_extra["first_id"] == newest_first[0]
        assert first.model_extra["last_id"] == newest_first[1]
        last = client.files.list(limit=2, after=newest_first[3])
        assert [f.id for f in last.data] == newest_first[4:] and last.has_more is False
        # the cursor's file deleted between pages: the next page still starts after it
        client.files.delete(newest_first[1])
        after_gone = client.files.list(limit=2, after=newest_first[1])
        assert [f.id for f in after_gone.data] == newest_first[2:4]
        with pytest.raises(openai.BadRequestError):
            client.files.list(limit=0)


def test_a_bad_line_is_accepted_at_upload_and_fails_the_batch(
    gateway: Gateway, tmp_path: Path
) -> None:
    lines = [
        batch_line("a", "fine"),
        batch_line("a", "custom_id used twice"),
        json.dumps({"custom_id": "b", "method": "GET", "url": "/v1/embeddings"}),
        "not json",
        "",  # blank lines are skipped, and counted in line numbers
        batch_line("c", "x").replace(MODEL, "gpt-4"),
        batch_line("d", "x").replace("/v1/embeddings", "/v1/chat/completions"),
    ]
    with gateway() as client:
        uploaded = upload(client, tmp_path / "bad.jsonl", lines)  # accepted, as OpenAI does
        batch = create_batch(client, uploaded.id)
        assert batch.status == "validating"
        batch = wait_final(client, batch.id)
    assert batch.status == "failed" and batch.failed_at is not None
    assert batch.output_file_id is None and batch.error_file_id is None
    errors = {(e.line, e.code, e.param) for e in batch.errors.data}
    assert errors == {
        (2, "duplicate_custom_id", "custom_id"),
        (3, "invalid_request", "method"),
        (4, "invalid_json_line", None),
        (6, "model_not_found", "body.model"),
        (7, "url_mismatch", "url"),
    }
    by_line = {e.line: e.message for e in batch.errors.data}
    assert "custom_id 'a' is used twice" in by_line[2] and "gpt-4" in by_line[6]


def test_requests_refused_on_their_own_are_answered_in_the_error_file_and_the_batch_completes(
    gateway: Gateway, tmp_path: Path
) -> None:
    """As OpenAI's Batch API: a request the online endpoint would refuse (an input over the
    model's context, bad ``dimensions``) fails alone, answered in the error file with the status
    and error body the endpoint gives it; the batch completes with the good lines embedded, and
    every custom_id is answered once. ``"truncate": true`` on a line has its input cut to fit."""
    long_text = "many words " * 400  # far over the model's 256 tokens
    good = [f"good-{n}" for n in range(6)]
    lines = [
        *(batch_line(custom_id, f"text number {n}") for n, custom_id in enumerate(good[:4])),
        batch_line("long", ["ok", long_text]),  # its second input is over
        batch_line(good[4], ["two", "inputs"], dimensions=32),
        batch_line("too-wide", "x", dimensions=4096),  # over the model's 384
        "",  # blank lines are skipped
        batch_line("no-width", "x", dimensions=0),
        batch_line("cut", long_text, truncate=True),
        batch_line("long-alone", long_text),
        batch_line(good[5], "the last one"),
    ]
    refused = {"long", "too-wide", "no-width", "long-alone"}
    with gateway() as client:
        uploaded = upload(client, tmp_path / "mixed.jsonl", lines)
        batch = wait_final(client, create_batch(client, uploaded.id).id)
        assert batch.status == "completed", batch
        assert batch.errors is None and batch.output_file_id and batch.error_file_id
        output = jsonl(client, batch.output_file_id)
        errors = jsonl(client, batch.error_file_id)
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (11, 7, 4)
    assert counts.total == counts.completed + counts.failed
    assert (len(output), len(errors)) == (counts.completed, counts.failed)
    # every custom_id once, across the two files
    answered = [r["custom_id"] for r in output + errors]
    assert sorted(answered) == sorted([*good, "cut", *refused])
    assert {r["custom_id"] for r in errors} == refused
    for record in output:
        assert record["error"] is None and record["response"]["status_code"] == 200
        assert record["id"].startswith("batch_req_")
    by_id = {r["custom_id"]: r for r in output + errors}
    assert [len(d["embedding"]) for d in by_id[good[4]]["response"]["body"]["data"]] == [32, 32]
    assert len(by_id[good[0]]["response"]["body"]["data"][0]["embedding"]) == 384
    assert by_id["cut"]["response"]["body"]["usage"]["prompt_tokens"] == 256
    # the error lines: OpenAI's shape for a request that got a response, an error response
    for record in errors:
        assert set(record) == {"id", "custom_id", "response", "error"}
        assert record["id"].startswith("batch_req_") and record["error"] is None
        response = record["response"]
        assert set(response) == {"status_code", "request_id", "body"}
        assert response["status_code"] == 400 and response["request_id"].startswith("req_")
        assert set(response["body"]) == {"error"}
        error = response["body"]["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["message"]
    error_of = {r["custom_id"]: r["response"]["body"]["error"] for r in errors}
    codes = {custom_id: (e["code"], e["param"]) for custom_id, e in error_of.items()}
    assert codes == {
        "long": ("context_length_exceeded", "body.input"),
        "long-alone": ("context_length_exceeded", "body.input"),
        "too-wide": ("invalid_dimensions", "dimensions"),
        "no-width": ("invalid_dimensions", "dimensions"),
    }
    assert "body.input[1]" in error_of["long"]["message"]
    assert "truncate" in error_of["long"]["message"]
    assert "384" in error_of["too-wide"]["message"]


def test_over_long_lines_are_cut_when_the_v1_default_is_to_truncate(
    gateway: Gateway, tmp_path: Path
) -> None:
    """EMBEDFLEET_GATEWAY_OPENAI_TRUNCATE=true: a line that does not say is cut, as online; one
    that says ``"truncate": false`` is still refused on its own."""
    long_text = "many words " * 400
    lines = [batch_line("cut", long_text), batch_line("kept", long_text, truncate=False)]
    with gateway(gateway_openai_truncate=True) as client:
        batch = create_batch(client, upload(client, tmp_path / "default.jsonl", lines).id)
        batch = wait_final(client, batch.id)
        [done] = jsonl(client, batch.output_file_id)
        [refused] = jsonl(client, batch.error_file_id)
    assert batch.status == "completed", batch
    assert done["custom_id"] == "cut" and done["response"]["body"]["usage"]["prompt_tokens"] == 256
    assert refused["custom_id"] == "kept"
    assert refused["response"]["body"]["error"]["code"] == "context_length_exceeded"


def test_a_batch_whose_every_request_is_refused_completes_with_an_error_file_only(
    gateway: Gateway, tmp_path: Path
) -> None:
    lines = [batch_line("wide", "x", dimensions=4096), batch_line("long", "many words " * 400)]
    with gateway() as client:
        batch = create_batch(client, upload(client, tmp_path / "refused.jsonl", lines).id)
        batch = wait_final(client, batch.id)
        errors = jsonl(client, batch.error_file_id) if batch.error_file_id else []
        output = client.files.content(batch.output_file_id).text if batch.output_file_id else None
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed) == (2, 0)
    assert batch.request_counts.failed == 2
    assert output == ""  # its output file has no lines
    assert sorted(r["custom_id"] for r in errors) == ["long", "wide"]


def test_the_request_and_input_caps_fail_the_batch_and_a_batch_within_them_runs(
    gateway: Gateway, tmp_path: Path
) -> None:
    within = [batch_line("one", "a"), batch_line("many", [f"t{n}" for n in range(7)])]
    over_inputs = [*within, batch_line("more", ["x", "y"])]  # 10 inputs
    over_lines = [batch_line(f"r{n}", "a") for n in range(4)]
    hour = {"anchor": "created_at", "seconds": 3600}
    with gateway(batch_max_inputs=9, batch_max_lines=3) as client:
        batches = {
            name: create_batch(
                client,
                upload(client, tmp_path / f"{name}.jsonl", lines).id,
                output_expires_after=hour,
            )
            for name, lines in (
                ("within", within),
                ("inputs", over_inputs),
                ("lines", over_lines),
            )
        }
        final = {name: wait_final(client, b.id) for name, b in batches.items()}
        output = jsonl(client, final["within"].output_file_id)
        output_file = client.files.retrieve(final["within"].output_file_id)
    assert final["within"].status == "completed" and len(output) == 2
    assert output_file.expires_at == output_file.created_at + 3600  # output_expires_after
    for name, setting in (("inputs", "BATCH_MAX_INPUTS"), ("lines", "BATCH_MAX_LINES")):
        batch = final[name]
        assert batch.status == "failed", name
        [error] = batch.errors.data
        assert error.code == "too_many_tasks" and error.line is None
        assert f"EMBEDFLEET_{setting}" in error.message and "split" in error.message


def test_a_deleted_input_file_fails_only_its_batch(
    gateway: Gateway, worker: WorkerProcess, fleet_settings: Settings, tmp_path: Path
) -> None:
    with gateway() as client:
        uploads = [
            upload(
                client,
                tmp_path / f"in{n}.jsonl",
                [batch_line(f"b{n}-{i}", f"batch {n} text {i}") for i in range(20)],
            )
            for n in range(6)
        ]
        # the worker stopped: the batches are validated and sent but none can finish, so the
        # file goes while its batch is in progress
        worker.send_signal(signal.SIGSTOP)
        try:
            batches = [create_batch(client, f.id) for f in uploads]
            for batch in batches:
                wait_until(client, batch.id, lambda b: b.status == "in_progress", timeout=60)
            client.files.delete(uploads[0].id)
        finally:
            worker.send_signal(signal.SIGCONT)
        final = [wait_final(client, b.id) for b in batches]
        outputs = [jsonl(client, b.output_file_id) for b in final[1:]]
    doomed = final[0]
    assert doomed.status == "failed" and doomed.failed_at is not None
    [error] = doomed.errors.data
    assert error.code == "input_file_missing" and uploads[0].id in error.message
    for n, (batch, records) in enumerate(zip(final[1:], outputs, strict=True), start=1):
        assert batch.status == "completed" and batch.request_counts.completed == 20
        assert sorted(r["custom_id"] for r in records) == sorted(f"b{n}-{i}" for i in range(20))
    assert list(Path(fleet_settings.files_dir).glob(".tmp-*")) == []


def test_a_full_disk_is_retried_with_its_reason_counted_and_leaves_no_temporaries(
    gateway: Gateway,
    fleet_settings: Settings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ENOSPC while one batch's output is published (the gateway runs in this process): that
    batch is retried, its reason counted, until the disk has room; the others are not held up."""
    publish = FileStore.publish
    refusals: dict[str, int] = {}
    target: list[str] = []

    def full_disk_for_one_batch(self, temp, filename, purpose, expires_after_s=None, **named):
        if target and filename.startswith(target[0]) and refusals.get(target[0], 0) < 3:
            refusals[target[0]] = refusals.get(target[0], 0) + 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return publish(self, temp, filename, purpose, expires_after_s, **named)

    monkeypatch.setattr(FileStore, "publish", full_disk_for_one_batch)
    with gateway() as client:
        uploads = [
            upload(
                client, tmp_path / f"d{n}.jsonl", [batch_line(f"d{n}-{i}", "t") for i in range(5)]
            )
            for n in range(3)
        ]
        target.append(create_batch(client, uploads[0].id).id)
        others = [create_batch(client, f.id) for f in uploads[1:]]
        final = [wait_final(client, batch_id) for batch_id in [target[0], *(b.id for b in others)]]
    assert [b.status for b in final] == ["completed"] * 3
    assert refusals == {target[0]: 3}
    record = redis.Redis.from_url(fleet_settings.effective_redis_url).hgetall(
        fleet_settings.keys.batch(target[0])
    )
    assert int(record[b"faults"]) == 3 and record[b"last_fault"].startswith(b"disk: ")
    assert list(Path(fleet_settings.files_dir).glob(".tmp-*")) == []


def test_the_sweep_removes_expired_files_and_stale_temporaries_only(tmp_path: Path) -> None:
    files = FileStore(tmp_path)
    source = files.temp_path("upload")
    source.write_text("x\n")
    gone = files.publish(source, "a.jsonl", "batch", expires_after_s=0)  # expires at once
    kept_source = files.temp_path("upload")
    kept_source.write_text("y\n")
    kept = files.publish(kept_source, "b.jsonl", "batch", expires_after_s=3600)
    stale, live = files.temp_path("output"), files.temp_path("output")
    stale.write_text("left by a writer that died")
    live.write_text("being written")
    old = time.time() - STALE_TEMP_S - 60
    os.utime(stale, (old, old))
    assert files.sweep() == (1, 1)
    assert not files.data_path(gone.id).exists() and files.data_path(kept.id).exists()
    assert not stale.exists() and live.exists()
    assert [f.id for f in files.list()[0]] == [kept.id]


def test_an_uploaded_file_expires_and_is_swept(
    gateway: Gateway, fleet_settings: Settings, tmp_path: Path
) -> None:
    files_dir = Path(fleet_settings.files_dir)
    with gateway(files_min_expiry_s=1) as client:
        keep = upload(client, tmp_path / "keep.jsonl", [batch_line("k", "x")])
        # OpenAI's default for batch files: 30 days
        assert keep.expires_at == keep.created_at + 30 * 24 * 3600
        with pytest.raises(openai.BadRequestError) as caught:
            upload(
                client,
                tmp_path / "short.jsonl",
                [batch_line("s", "x")],
                expires_after={"anchor": "created_at", "seconds": 0},
            )
        assert "EMBEDFLEET_FILES_MIN_EXPIRY_S" in caught.value.message
        brief = upload(
            client,
            tmp_path / "brief.jsonl",
            [batch_line("b", "x")],
            expires_after={"anchor": "created_at", "seconds": 2},
        )
        assert brief.expires_at == brief.created_at + 2
        assert brief.id in [f.id for f in client.files.list()]
        deadline = time.monotonic() + 30
        while True:
            try:
                client.files.retrieve(brief.id)
            except openai.NotFoundError:
                break
            assert time.monotonic() < deadline, "the file did not expire"
            time.sleep(0.1)  # polling the gateway's state, not waiting blind
        listed = [f.id for f in client.files.list()]
        assert brief.id not in listed and keep.id in listed
        with pytest.raises(openai.NotFoundError):
            client.files.content(brief.id)
        # the sweep frees its disk space (and only its)
        deadline = time.monotonic() + 60
        while (files_dir / f"{brief.id}.data").exists():
            assert time.monotonic() < deadline, "the expired file was not swept"
            time.sleep(0.1)  # polling the files directory, not waiting blind
        assert (files_dir / f"{keep.id}.data").exists()


def test_an_expired_batch_keeps_what_finished(
    gateway: Gateway, worker: WorkerProcess, tmp_path: Path
) -> None:
    """Last in the module: the expired batch's unsent work stays on the ingest stream."""
    count = 20_000
    lines = [batch_line(f"e{n}", f"short text number {n}") for n in range(count)]
    window_s = 20
    with gateway(batch_completion_window_s=window_s) as client:
        batch = create_batch(client, upload(client, tmp_path / "big.jsonl", lines).id)
        assert batch.expires_at == batch.created_at + window_s
        # some requests finish, then the worker stops, so the window ends with work undone
        wait_until(client, batch.id, lambda b: b.request_counts.completed > 0, window_s)
        worker.send_signal(signal.SIGSTOP)
        try:
            batch = wait_final(client, batch.id, timeout=window_s + 60)
        finally:
            worker.send_signal(signal.SIGCONT)
        assert batch.status == "expired" and batch.expired_at >= batch.expires_at
        output = jsonl(client, batch.output_file_id)
        errors = jsonl(client, batch.error_file_id)
        output_file = client.files.retrieve(batch.output_file_id)
    counts = batch.request_counts
    assert counts.total == count and 0 < counts.completed < count
    assert counts.completed == len(output) and counts.failed == len(errors)
    assert sorted(r["custom_id"] for r in output + errors) == sorted(f"e{n}" for n in range(count))
    for record in output:
        assert record["response"]["status_code"] == 200
        assert len(record["response"]["body"]["data"][0]["embedding"]) > 0
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert output_file.expires_at == output_file.created_at + 30 * 24 * 3600
