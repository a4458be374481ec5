"""The host pipeline benchmark (loadtest/host_pipeline.py, issue 29) at tiny numbers: it runs
end to end through a real redis-server with stand-in worker processes, times every stage and
writes its table and its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from loadtest.host_pipeline import STAGES, main

# slow: starts worker processes (a stand-in model each). Not serial: it asserts shapes and a
# ratio within one process (ids against tokenizing), no time or rate, so it shares the cores
pytestmark = pytest.mark.slow


def test_host_pipeline_smoke(tmp_path: Path) -> None:
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
