"""The host pipeline benchmark (loadtest/host_pipeline.py, issue 29) at tiny numbers: it runs
end to end through a real redis-server with stand-in worker processes, times every stage and
writes its table and its JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO

import pytest
from click.testing import CliRunner

from loadtest import host_pipeline
from loadtest.host_pipeline import STAGES, main
from tests import forks

# slow: starts worker processes (a stand-in model each). Not serial: it asserts shapes and a
# ratio within one process (ids against tokenizing), no time or rate, so it shares the cores
pytestmark = pytest.mark.slow


class ForkedChild:
    """A benchmark's worker child forked from tests/forks.py's server (its imports are the
    seconds a fresh one spends before it says ``loaded``), with the text pipes the benchmark
    reads and writes; what it measures starts after that."""

    def __init__(self, command: list[str], env: dict[str, str], cpus: list[int] | None) -> None:
        assert command[1] == "-m" and cpus is None, command  # the smoke run pins no core
        stdin_read, stdin_write = os.pipe()
        stdout_read, stdout_write = os.pipe()
        try:
            self.process = forks.popen(
                command[3:], env=env, stdin=stdin_read, stdout=stdout_write, module=command[2]
            )
        finally:
            os.close(stdin_read)
            os.close(stdout_write)
        self.stdin: IO[str] = open(stdin_write, "w")  # noqa: SIM115 (closed by the benchmark)
        self.stdout: IO[str] = open(stdout_read)  # noqa: SIM115 (closed in wait)

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def poll(self) -> int | None:
        return self.process.poll()

    def wait(self, timeout: float | None = None) -> int:
        returncode = self.process.wait(timeout)
        self.stdout.close()
        return returncode

    def kill(self) -> None:
        self.process.kill()


def test_host_pipeline_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_pipeline, "start_child", ForkedChild)
    out = tmp_path / "host.json"
    arguments = ["--texts", "60", "--processes", "1", "--rounds", "1", "--json", str(out)]
    # redis-server pinned to each run's CPUs (here all of them: no --cores)
    arguments.append("--redis-beside")
    # each configuration beside its twin with one tokenizer thread (the A/B of stop 65)
    arguments += ["--variants", "worker,one-opening"]
    result = CliRunner().invoke(main, arguments)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["tokenizer_floor_texts_per_s"] > 0
    assert report["redis_beside"] is True
    assert {(c["processes"], c["path"], c["variant"]) for c in report["configs"]} == {
        (1, path, variant)
        # "ids": the chunks carry their producer's token ids (issue 53)
        for path in ("before", "after", "ids")
        for variant in ("worker", "one-opening")
    }
    for config in report["configs"]:
        assert config["texts_per_s"] > 0 and config["tokens_per_s"] > config["texts_per_s"]
        timed = {row["stage"]: row["us_per_entry"] for row in config["stages"]}
        assert list(timed) == [stage for stage, _ in STAGES]
        # every stage the worker runs per entry was seen (the wrappers are on its path)
        for stage in ("decode + validate", "collate", "cast", "pack msgpack"):
            assert timed[stage] > 0, stage
        assert config["thread_cpu_share"]["tokenizer"] > 0
        # the whole process's CPU, its threads' and the native pools' (the tokenizer's own)
        assert "native pools" in config["thread_cpu_share"]
        # redis-server's own CPU in the run, by INFO cpu: what it takes of a small host's cores
        assert config["redis_cores"] > 0 and config["redis_us_per_text"] > 0
    # the worker tokenizes the texts unless the producer sent their ids (what it still
    # tokenizes then are its own probes' texts)
    tokenize = {
        config["path"]: {row["stage"]: row["us_per_entry"] for row in config["stages"]}["tokenize"]
        for config in report["configs"]
        if config["variant"] == "worker"
    }
    assert tokenize["ids"] < 0.5 * tokenize["after"], tokenize
    assert "| tokenize | tokenizer |" in result.output
    assert "per process ÷ tokenizer floor" in result.output
    assert "producer's token ids ÷ tokenizing, texts per CPU second" in result.output
    assert "the worker ÷ one-opening, 1 process, after, texts/s: per round" in result.output
