"""structlog setup: JSON lines for machines, colours for people on a terminal.

One writer for everything that logs, so that log lines and a progress bar can share a terminal:

- structlog lines, and the records of libraries that log through the standard ``logging``
  module, go to stderr through ``tqdm.write``, which clears any progress bar on screen, writes
  the line and draws the bar again below it (the bar never tears, the line never starts in the
  middle of a bar frame);
- the libraries the model runtime brings (transformers, torch, tokenizers, huggingface_hub,
  sentence-transformers) and Python's ``warnings`` speak only at the error level by default:
  their warnings are about training configs, tracing internals and deprecations, nothing a user
  of the fleet can act on. ``EMBEDFLEET_LOG_LEVEL=debug`` (``embedfleet --verbose``) shows them.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

import structlog
from tqdm import tqdm

# Loggers of the model runtime's libraries: quiet unless the user asks for debug output.
THIRD_PARTY_LOGGERS = (
    "transformers",
    "torch",
    "tokenizers",
    "huggingface_hub",
    "sentence_transformers",
    "py.warnings",  # warnings.warn(), routed to logging by logging.captureWarnings
)
THIRD_PARTY_DEFAULT_LEVEL = logging.ERROR
THIRD_PARTY_VERBOSE_LEVEL = logging.WARNING  # at debug: their warnings, not their own debug
FOREIGN_MIN_LEVEL = logging.WARNING  # every other library that logs through `logging`


class BarAwareStderr:
    """stderr as a file for loggers: each line goes through ``tqdm.write``, which clears the
    progress bars on the terminal, writes the line and redraws the bars under it. Without a bar
    it is a plain write. ``sys.stderr`` is looked up on every write (tests swap it)."""

    def write(self, text: str) -> int:
        tqdm.write(text.removesuffix("\n"), file=sys.stderr)
        return len(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


@dataclass(frozen=True)
class _Configured:
    level: int


_configured: _Configured | None = None


def wants_colour() -> bool:
    """Colour on stderr: a terminal, and NO_COLOR unset or empty."""
    return sys.stderr.isatty() and not os.environ.get("NO_COLOR")


def configure_logging(level: str = "info", fmt: str = "auto") -> None:
    """Configure structlog and the standard ``logging`` module once per process.

    ``fmt`` is auto | json | console (auto: console on a terminal, JSON lines otherwise).
    """
    global _configured
    use_console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        # no colour codes in a file or a pipe (they would be bytes of noise there), nor where
        # the person asked for none (https://no-color.org: NO_COLOR set and not empty)
        structlog.dev.ConsoleRenderer(colors=wants_colour())
        if use_console
        else structlog.processors.JSONRenderer()
    )
    numeric_level = logging.getLevelName(level.upper())
    if not isinstance(numeric_level, int):
        numeric_level = logging.INFO
    stream = BarAwareStderr()
    timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            timestamper,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.WriteLoggerFactory(file=stream),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    # The standard library's records (other libraries) render like ours, on the same stream.
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processor=renderer,
            foreign_pre_chain=[
                structlog.stdlib.add_logger_name,
                structlog.stdlib.add_log_level,
                timestamper,
            ],
        )
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_embedfleet", False)]:
        root.removeHandler(old)
    handler._embedfleet = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    # Other libraries' info and debug records (asyncio's selector, redis-py's handshake) are
    # their developers' business: warnings and errors only, at every level of ours.
    root.setLevel(max(numeric_level, FOREIGN_MIN_LEVEL))
    logging.captureWarnings(True)
    _configured = _Configured(numeric_level)
    for name in THIRD_PARTY_LOGGERS:
        adopt_library_logger(name)


def adopt_library_logger(name: str) -> None:
    """Route the ``logging`` logger ``name`` through our handler at our level for it.

    Some libraries install their own stderr handler and stop propagation when first imported
    (transformers does): call this after importing them. Without ``configure_logging`` (the
    package used as a library) it does nothing: the application owns its logging then.
    """
    if _configured is None:
        return
    logger = logging.getLogger(name)
    for own_handler in list(logger.handlers):
        logger.removeHandler(own_handler)
    logger.propagate = True
    if _configured.level <= logging.DEBUG:
        logger.setLevel(THIRD_PARTY_VERBOSE_LEVEL)
    else:
        logger.setLevel(max(THIRD_PARTY_DEFAULT_LEVEL, _configured.level))


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name)
