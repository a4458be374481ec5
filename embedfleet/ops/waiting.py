"""How the CLI verbs wait for Redis: they say so once on stderr, say when it is back, and end
with a message (exit status 1, no traceback) if it stays away past EMBEDFLEET_REDIS_RETRY_S.

The notices are written with ``tqdm.write``, which clears an active progress bar, prints the
line above it and draws the bar again, so ``embedfleet enqueue --wait`` keeps its bar across an
outage.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import click
from tqdm import tqdm

from embedfleet.producer.client import JobTimeoutError, Producer
from embedfleet.shared.logging import configure_logging
from embedfleet.shared.model_registry import UnknownModelError
from embedfleet.shared.retry import RedisUnavailableError, describe
from embedfleet.shared.settings import Settings, SettingsError, load_settings

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


redis_url_option = click.option(
    "--redis-url", envvar="EMBEDFLEET_REDIS_URL", help="Redis URL (or EMBEDFLEET_REDIS_URL)."
)


def json_report_option(what: str) -> Callable[[F], F]:
    """``--json``: the verb's report as one JSON object on stdout, for scripts."""
    return click.option("--json", "as_json", is_flag=True, help=f"Print {what} as one JSON object.")


def count_option(
    *param_decls: str, minimum: int = 1, maximum: int | None = None, **attrs: Any
) -> Callable[[F], F]:
    """A whole number from ``minimum`` (to ``maximum``); --help shows the range and the default."""
    return click.option(
        *param_decls, type=click.IntRange(minimum, maximum), show_default=True, **attrs
    )


def seconds_option(
    *param_decls: str, minimum: float = 0, min_open: bool = False, **attrs: Any
) -> Callable[[F], F]:
    """Seconds from ``minimum`` (above it with ``min_open``); --help shows the range, its bound
    as written (0, not 0.0), and the default."""
    return click.option(
        *param_decls, type=click.FloatRange(minimum, min_open=min_open), show_default=True, **attrs
    )


def input_file_option(*param_decls: str, **attrs: Any) -> Callable[[F], F]:
    """A file the verb reads: it must exist, and not be a folder."""
    return click.option(
        *param_decls, type=click.Path(exists=True, dir_okay=False, path_type=Path), **attrs
    )


def verb_settings(redis_url: str | None) -> Settings:
    """The settings from EMBEDFLEET_* variables, ``--redis-url`` over them; a bad value ends
    the verb with its message (no traceback)."""
    try:
        return load_settings(**({"redis_url": redis_url} if redis_url else {}))
    except SettingsError as error:
        raise click.ClickException(str(error)) from None


class StderrNotice:
    """An ``OutageListener`` for people at a terminal (and for logs that keep stderr)."""

    def redis_down(self, server: str, error: BaseException, give_up_after_s: float) -> None:
        tqdm.write(
            f"waiting for Redis at {server} ({describe(error)}); retrying for up to "
            f"{give_up_after_s:g}s",
            file=sys.stderr,
        )

    def redis_back(self, server: str, down_s: float) -> None:
        tqdm.write(f"Redis at {server} is back after {down_s:.1f}s", file=sys.stderr)


model_option = click.option(
    "--model",
    default=None,
    metavar="NAME",
    help="The model to use in a namespace serving several (`embedfleet status` lists them; "
    "a model lane's name, or the default model's served name). Default: the namespace's "
    "default model (or EMBEDFLEET_MODEL_LANE's).",
)


def client_for(settings: Settings, model: str | None = None) -> Producer:
    """The verbs' client: it says on stderr when it waits for Redis, and when Redis is back.

    Its log lines go to stderr too (structlog would print them on stdout, among the verb's
    output: `status --json` frames, `enqueue`'s summary).
    """
    configure_logging(settings.log_level, settings.log_format)
    return Producer(
        settings,
        on_outage=StderrNotice(),
        first_contact_s=settings.redis_connect_s,
        model=model,
    )


def run_client(main: Coroutine[Any, Any, T]) -> T:
    """Run a verb's coroutine; Redis away for longer than EMBEDFLEET_REDIS_RETRY_S (or a job
    not finished within --timeout, or a --model no worker serves) ends it with the message,
    exit status 1, no traceback."""
    try:
        return asyncio.run(main)
    except (RedisUnavailableError, JobTimeoutError, UnknownModelError) as error:
        raise click.ClickException(str(error)) from None
