"""workers/cli.py: `embedfleet worker` refuses bad settings and a bad sink with one line naming
the setting, before any model is loaded or Redis is reached."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from embedfleet.workers.cli import worker_command


def test_a_bad_flag_value_names_its_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EMBEDFLEET_REPLICAS", raising=False)
    result = CliRunner().invoke(worker_command, ["--replicas", "lots"])
    assert result.exit_code == 1
    assert result.output.startswith("Error: bad settings:")
    assert "EMBEDFLEET_REPLICAS" in result.output and "from 1 to 64" in result.output
    assert "Traceback" not in result.output


def test_a_bad_sink_is_refused_before_the_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBEDFLEET_SINK", "bogus://")
    result = CliRunner().invoke(worker_command, [])
    assert result.exit_code == 1
    assert result.output.startswith("Error: EMBEDFLEET_SINK='bogus://': unknown sink scheme")
    assert "postgresql://" in result.output, "it lists the schemes there are"
