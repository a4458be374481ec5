"""The command line, run as a user runs it: real processes against a real server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest

from embedfleet.shared.exit_codes import ExitCode
from embedfleet.shared.settings import Settings
from tests import forks
from tests.conftest import WorkerLauncher, until
from tests.paths import REPO_ROOT

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model. Not
# serial: no assertion holds a time (each bound is a timeout, the readme example's included), so
# it runs in test-full's parallel tier
pytestmark = pytest.mark.slow

VERBS = ["demo", "worker", "enqueue", "results", "query", "status", "search", "index", "dead"]
# the demos' workers run queries eager, as every test worker (tests/conftest.py's worker_env):
# a demo's default query path, the frozen graph, is tests/end_to_end/test_terminal.py's
DEMO_ENV = {"EMBEDFLEET_REDIS_URL": "", "EMBEDFLEET_FROZEN_QUERIES": "false"}


def embedfleet(
    *args: str, env: dict[str, str] | None = None, stdin: str | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    return forks.run(
        args, text=True, env={**os.environ, **(env or {})}, input=stdin, timeout=timeout
    )


@pytest.mark.parametrize("verb", [None, *VERBS])
def test_every_verb_explains_itself(verb: str | None) -> None:
    result = embedfleet(*([verb] if verb else []), "--help")
    assert result.returncode == 0, result.stderr
    assert "Usage: " in result.stdout
    assert len(result.stdout.splitlines()) > 6


def _env(settings: Settings) -> dict[str, str]:
    return {
        "EMBEDFLEET_REDIS_URL": settings.effective_redis_url,
        "EMBEDFLEET_NAMESPACE": settings.namespace,
        "EMBEDFLEET_BLOCK_MS": "200",
        "EMBEDFLEET_LOG_FORMAT": "json",
    }


def test_enqueue_reports_bad_lines_and_keeps_the_good(settings: Settings, tmp_path: Path) -> None:
    source = tmp_path / "chunks.jsonl"
    source.write_text(
        '{"id": "a", "text": "alpha"}\nnot json\n{"id": 5, "text": "x"}\n'
        '{"id": "b", "text": "beta", "meta": {"page": 2}}\n'
    )
    result = embedfleet("enqueue", str(source), "--job", "j1", env=_env(settings))
    assert result.returncode == ExitCode.REJECTED_LINES == 4
    assert "enqueued 2 chunks as job 'j1'" in result.stdout
    assert "line 2: not JSON" in result.stderr and "line 3: 'id' must be" in result.stderr


def test_enqueue_again_says_what_was_already_there_and_force_adds_it(
    settings: Settings, tmp_path: Path
) -> None:
    source = tmp_path / "chunks.jsonl"
    source.write_text('{"id": "a", "text": "alpha"}\n{"id": "b", "text": "beta"}\n')
    env = _env(settings)
    first = embedfleet("enqueue", str(source), "--job", "j", env=env)
    assert first.returncode == 0 and "enqueued 2 chunks as job 'j'" in first.stdout
    again = embedfleet("enqueue", str(source), "--job", "j", env=env)
    assert again.returncode == 0, again.stderr
    assert "enqueued 0 of 2 chunks as job 'j'" in again.stdout
    assert "2 chunks were already in job 'j'" in again.stderr and "--force" in again.stderr
    report = embedfleet("enqueue", str(source), "--job", "j", "--json", env=env)
    assert json.loads(report.stdout) == {
        "job": "j",
        "model": None,
        "enqueued": 0,
        "already_present": 2,
        "rejected_lines": [],
    }
    forced = embedfleet("enqueue", str(source), "--job", "j", "--force", "--json", env=env)
    assert json.loads(forced.stdout)["enqueued"] == 2, forced.stderr


def test_enqueue_wait_then_export(
    workers: WorkerLauncher, settings: Settings, tmp_path: Path
) -> None:
    env = _env(settings)
    # The worker's text limit is below the client's: a chunk over it is dead-lettered (too_large)
    worker = workers.process("cli", settings, EMBEDFLEET_MAX_TEXT_CHARS="2000")
    try:
        # its start (a model load) is not what --wait's --timeout bounds below
        asyncio.run(worker.wait_for_log('"worker started"'))
        lines = [
            json.dumps({"id": f"doc{i}", "text": f"document number {i} about cats"})
            for i in range(25)
        ]
        result = embedfleet(
            "enqueue",
            "-",
            "--job",
            "cats",
            "--wait",
            "--timeout",
            "120",
            env=env,
            stdin="\n".join(lines) + "\n",
        )
        assert result.returncode == ExitCode.OK, result.stderr
        oversized = json.dumps({"id": "huge", "text": "cats " * 1000})
        with_dead = embedfleet(
            "enqueue", "-", "--job", "dead", "--wait", "--json", env=env, stdin=oversized + "\n"
        )
        assert with_dead.returncode == ExitCode.DEAD_LETTERS == 3, with_dead.stderr
        assert "embedfleet dead list --job dead" in with_dead.stderr
        assert json.loads(with_dead.stdout) == {
            "job": "dead",
            "model": None,
            "enqueued": 1,
            "already_present": 0,
            "rejected_lines": [],
            "dead_lettered": 1,
        }
        purged = embedfleet("dead", "purge", "--job", "dead", "--yes", "--json", env=env)
        assert json.loads(purged.stdout) == {"purged": 1}, purged.stderr
        misused = embedfleet("enqueue", "-", "--timeout", "5", env=env, stdin=lines[0] + "\n")
        assert misused.returncode == ExitCode.USAGE and "--timeout applies only with --wait" in (
            misused.stderr
        )
        npz = tmp_path / "out.npz"
        jsonl = tmp_path / "out.jsonl"
        assert embedfleet("results", "--job", "cats", "--out", str(npz), env=env).returncode == 0
        assert embedfleet("results", "--job", "cats", "--out", str(jsonl), env=env).returncode == 0
        query = embedfleet("query", "a question about cats", "--json", env=env)
        assert query.returncode == 0, query.stderr
        assert json.loads(query.stdout)["dim"] == 384
        bad = embedfleet("results", "--out", str(tmp_path / "out.csv"), env=env)
        assert bad.returncode == 2 and ".npz or .jsonl" in bad.stderr
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0, worker.log()[-2000:]
    archive = np.load(npz)
    assert sorted(archive["ids"].tolist()) == sorted(f"doc{i}" for i in range(25))
    assert archive["vectors"].shape == (25, 384) and archive["vectors"].dtype == np.float16
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(rows) == 25 and len(rows[0]["vector"]) == 384
    norms = np.linalg.norm(archive["vectors"].astype(np.float32), axis=1)
    assert np.allclose(norms, 1.0, atol=1e-2)


def test_demo_runs_on_embedded_defaults(tmp_path: Path) -> None:
    result = embedfleet("demo", "--limit", "150", "--out-dir", str(tmp_path), env=DEMO_ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "embedded 150 texts" in result.stdout and "texts/s" in result.stdout
    assert "embedded Valkey" in result.stdout
    # stderr is a pipe here: progress as summary log lines, never bar frames
    assert "\r" not in result.stderr and "embedding: finished" in result.stderr
    # the sample search finds the built-in corpus' answer and says what it is
    assert "coroutine" in result.stdout  # e.g. `Functions defined with "async def" syntax are ...`
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["texts"] == 150 and summary["texts_per_s"] > 0
    assert np.load(tmp_path / "vectors.npz")["vectors"].shape == (150, 384)


OWN_CORPUS = [
    ("billing", "Invoices are sent on the first day of every month to the account's owner."),
    ("password", "To reset your password, open Settings, choose Security and click Reset."),
    ("shipping", "Orders ship within two business days; tracking numbers arrive by email."),
    ("refunds", "Refunds go back to the original card within ten days of the return."),
    ("api", "API keys are created on the Developers page and shown only once."),
    ("support", "Our support team answers chat messages from 9 to 5 on weekdays."),
]


def test_demo_searches_a_corpus_of_ones_own_with_ones_own_query(tmp_path: Path) -> None:
    """`--corpus` with `--query`: the closing search is the user's question on the user's
    corpus (the built-in query about Python's docs found nothing there: top score 0.003)."""
    corpus = tmp_path / "mine.jsonl"
    corpus.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in OWN_CORPUS))
    question = "I forgot my login password, how can I change it?"
    out = tmp_path / "out"
    result = embedfleet(
        "demo", "--corpus", str(corpus), "--query", question, "--out-dir", str(out), env=DEMO_ENV
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    at = lines.index(f"search: top 3 for {question!r}")
    assert "password" in lines[at + 1], result.stdout  # the top hit is the password entry
    assert f"embedfleet search {question!r}" in result.stdout


def test_demo_with_a_corpus_and_no_query_says_what_to_give(tmp_path: Path) -> None:
    """A corpus of one's own without --query is refused at once, naming the option (nothing
    is started: no Redis, no model)."""
    from click.testing import CliRunner

    from embedfleet import demo

    corpus = tmp_path / "mine.jsonl"
    corpus.write_text(json.dumps({"id": "a", "text": "hello"}) + "\n")
    refused = CliRunner().invoke(demo.demo_command, ["--corpus", str(corpus)])
    assert refused.exit_code == 2, refused.output  # click's usage error
    assert "--corpus needs --query" in refused.output
    empty = CliRunner().invoke(demo.demo_command, ["--corpus", str(corpus), "--query", " "])
    assert empty.exit_code == 2 and "--query is empty" in empty.output
    assert demo.demo_query(None, None) == demo.SAMPLE_QUERY  # the built-in corpus' own


async def test_readme_redis_cli_example_is_embedded(
    workers: WorkerLauncher, redis_server, encoder, tmp_path: Path
) -> None:
    """The ingestion page's by-hand XADD (docs/INGESTION.md), run literally with redis-cli,
    comes back as a vector."""
    import re
    import shutil

    from embedfleet.producer import Producer
    from embedfleet.shared.redis_conn import connect

    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli not on PATH")
    page = (REPO_ROOT / "docs" / "INGESTION.md").read_text()
    command = re.search(r"^(printf '[^']+' \\\n\s+\| redis-cli -x XADD [^\n]+)$", page, re.M)
    assert command, "docs/INGESTION.md lost its redis-cli example"
    line = command.group(1).replace("redis-cli", f"redis-cli -p {redis_server.port}")
    settings = Settings(redis_url=redis_server.url, block_ms=100, log_format="json")
    client = connect(settings.effective_redis_url)
    try:
        await client.delete(settings.keys.results, settings.keys.ingest)
        async with workers.run(settings):
            subprocess.run(["sh", "-c", line], check=True, capture_output=True)

            async def a_result() -> bool:
                return bool(await client.xlen(settings.keys.results))

            # a bound, not a time under test: ten seconds were missed on a loaded 2-core CPU
            await until(a_result, timeout=120)
        results = [r async for r in Producer(settings, client).results()]
    finally:
        await client.delete(*[k async for k in client.scan_iter("embedfleet:*")])
        await client.aclose()
    assert [r.id for r in results] == ["doc-1"]
    expected = encoder.embed_texts(["hello world"])[0]
    assert float(np.dot(results[0].vector.astype(np.float32), expected)) > 0.999


def test_bad_setting_is_a_clear_error_not_a_traceback() -> None:
    result = embedfleet("worker", env={"EMBEDFLEET_DTYPE": "int3"})
    assert result.returncode == 1
    assert "EMBEDFLEET_DTYPE" in result.stderr and "Traceback" not in result.stderr


def test_demo_json_prints_the_summary_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--json prints summary.json as one object instead of the report's lines (the run itself
    is test_demo_runs_on_embedded_defaults')."""
    from click.testing import CliRunner

    from embedfleet import demo

    figures = {"texts": 3, "dead": 0, "seconds": 1.5, "texts_per_s": 2.0}

    class Report:
        def lines(self) -> list[str]:
            return ["the text report"]

    def fake_run(corpus, limit, out_dir: Path, redis_url, query=None) -> Report:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "summary.json").write_text(json.dumps(figures, indent=2))
        return Report()

    monkeypatch.setattr(demo, "run_demo", fake_run)
    as_json = CliRunner().invoke(demo.demo_command, ["--out-dir", str(tmp_path), "--json"])
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.output) == figures
    as_text = CliRunner().invoke(demo.demo_command, ["--out-dir", str(tmp_path)])
    assert as_text.output.strip() == "the text report"
