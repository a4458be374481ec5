"""Logging for people: other libraries' warnings only with --verbose, progress without a bar
when nobody watches a terminal (tests/end_to_end/test_terminal.py checks the screen itself)."""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Iterator

import pytest
import structlog

from embedfleet.shared import logging as shared_logging
from embedfleet.shared.logging import adopt_library_logger, configure_logging
from embedfleet.shared.progress import Progress

LOSS_TYPE_WARNING = "`loss_type=None` was set in the config but it is unrecognized."


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """configure_logging changes process-wide state: put it back for the other tests."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    library_state = {
        name: (list(logging.getLogger(name).handlers), logging.getLogger(name).level)
        for name in shared_logging.THIRD_PARTY_LOGGERS
    }
    transformers_logger = logging.getLogger("transformers")
    transformers_state = (list(transformers_logger.handlers), transformers_logger.propagate)
    yield
    structlog.reset_defaults()
    logging.captureWarnings(False)
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, (own_handlers, own_level) in library_state.items():
        logging.getLogger(name).handlers[:] = own_handlers
        logging.getLogger(name).setLevel(own_level)
    transformers_logger.handlers[:], transformers_logger.propagate = transformers_state
    shared_logging._configured = None


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _transformers_warning() -> None:
    from transformers.utils import logging as transformers_logging

    # transformers' own logger, with the handler it installs on import
    transformers_logging.get_logger("transformers.modeling_utils").warning(LOSS_TYPE_WARNING)


@pytest.mark.usefixtures("restore_logging")
def test_transformers_warnings_only_at_debug_and_in_our_format(capsys) -> None:
    import transformers  # noqa: F401  (installs its own stderr handler, as on any import)

    configure_logging("info", "json")
    adopt_library_logger("transformers")  # what workers/model/encoder.py does after importing it
    _transformers_warning()
    assert capsys.readouterr().err == ""

    configure_logging("debug", "json")
    _transformers_warning()
    err = capsys.readouterr().err
    assert "[transformers]" not in err  # transformers' own handler did not print it
    [line] = _json_lines(err)
    assert line["event"] == LOSS_TYPE_WARNING
    assert line["level"] == "warning" and line["logger"] == "transformers.modeling_utils"


@pytest.mark.usefixtures("restore_logging")
def test_python_warnings_only_at_debug(capsys) -> None:
    configure_logging("info", "json")
    warnings.warn("TracerWarning-like noise", UserWarning, stacklevel=1)
    assert capsys.readouterr().err == ""
    configure_logging("debug", "json")
    warnings.warn("TracerWarning-like noise", UserWarning, stacklevel=1)
    [line] = _json_lines(capsys.readouterr().err)
    assert "TracerWarning-like noise" in line["event"] and line["logger"] == "py.warnings"


@pytest.mark.usefixtures("restore_logging")
def test_other_libraries_chatter_stays_out_even_at_debug(capsys) -> None:
    configure_logging("debug", "json")
    logging.getLogger("asyncio").debug("Using selector: EpollSelector")
    logging.getLogger("redis.connection").warning("a real warning from redis-py")
    structlog.get_logger("embedfleet.test").debug("ours")
    events = [line["event"] for line in _json_lines(capsys.readouterr().err)]
    assert events == ["a real warning from redis-py", "ours"]


@pytest.mark.usefixtures("restore_logging")
def test_progress_off_a_terminal_logs_summary_lines_not_bar_frames(capsys) -> None:
    configure_logging("info", "json")
    # pytest's captured stderr is not a terminal: the same choice as a redirected CLI
    with Progress("embedding", "texts", total=3, interval_s=0) as progress:
        for _ in range(3):
            progress.update()
    err = capsys.readouterr().err
    assert "\r" not in err and "|" not in err  # no bar frame
    lines = _json_lines(err)
    assert [line["texts"] for line in lines] == [1, 2, 3, 3]
    assert lines[-1]["event"] == "embedding: finished" and lines[-1]["total"] == 3


@pytest.mark.usefixtures("restore_logging")
def test_progress_off_a_terminal_logs_once_per_interval(capsys) -> None:
    configure_logging("info", "json")
    with Progress("enqueue", "chunks", interval_s=3600) as progress:
        for _ in range(1000):
            progress.update(5)
    lines = _json_lines(capsys.readouterr().err)
    assert [(line["event"], line["chunks"]) for line in lines] == [("enqueue: finished", 5000)]


def test_no_color_turns_colours_off_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    from embedfleet.shared import logging as fleet_logging

    monkeypatch.setattr(fleet_logging.sys.stderr, "isatty", lambda: True)
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert fleet_logging.wants_colour()
    monkeypatch.setenv("NO_COLOR", "")  # empty: as if unset (no-color.org)
    assert fleet_logging.wants_colour()
    monkeypatch.setenv("NO_COLOR", "1")
    assert not fleet_logging.wants_colour()
