"""``--verbose``: debug logs, third-party warnings included, for any verb that logs."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import click

Command = TypeVar("Command", bound=Callable[..., object])


def _set_verbose(_context: click.Context, _param: click.Parameter, verbose: bool) -> None:
    # Through the environment, so that the settings every verb loads (and any worker process a
    # verb starts) see it like EMBEDFLEET_LOG_LEVEL=debug set by hand.
    if verbose:
        os.environ["EMBEDFLEET_LOG_LEVEL"] = "debug"


def verbose_option(command: Command) -> Command:
    return click.option(
        "--verbose",
        "-v",
        is_flag=True,
        expose_value=False,
        is_eager=True,
        callback=_set_verbose,
        help="Log at debug level, with the warnings of transformers, torch and the like "
        "(same as EMBEDFLEET_LOG_LEVEL=debug).",
    )(command)
