"""`embedfleet worker`."""

from __future__ import annotations

import click

from shared.settings import SettingsError, load_settings


@click.command("worker")
@click.option(
    "--redis-url", envvar="EMBEDFLEET_REDIS_URL", help="Redis URL (or EMBEDFLEET_REDIS_URL)."
)
@click.option("--model", default=None, help="Model name or local directory (EMBEDFLEET_MODEL).")
def worker_command(redis_url: str | None, model: str | None) -> None:
    """Embed chunks from the ingest stream until SIGTERM.

    Reads {namespace}:ingest through the consumer group in bulk, embeds, writes fp16 vectors to
    {namespace}:results and acknowledges. SIGTERM or Ctrl-C drains (finishes and acknowledges
    what it holds, then exits 0); a second signal exits at once and leaves entries pending for
    other workers. Every setting comes from EMBEDFLEET_* variables (see the README table).
    """
    from workers.runtime import run_worker  # heavy imports (torch) only when running

    overrides = {
        key: value for key, value in {"redis_url": redis_url, "model": model}.items() if value
    }
    try:
        settings = load_settings(**overrides)
    except SettingsError as error:
        raise click.ClickException(str(error)) from None
    run_worker(settings)
