"""`embedfleet worker`."""

from __future__ import annotations

import sys

import click

from embedfleet.shared.extras import require_worker_extra
from embedfleet.shared.fault_kinds import WorkerFault
from embedfleet.shared.settings import SettingsError, load_settings
from embedfleet.shared.verbosity import verbose_option
from embedfleet.sinks import MissingExtraError, SinkSetupError, SinkURLError, check_sink


@click.command("worker")
@click.option(
    "--redis-url", envvar="EMBEDFLEET_REDIS_URL", help="Redis URL (or EMBEDFLEET_REDIS_URL)."
)
@click.option("--model", default=None, help="Model name or local directory (EMBEDFLEET_MODEL).")
@click.option(
    "--query-only",
    is_flag=True,
    default=None,
    help="Serve only the priority query stream (dedicated query replicas; EMBEDFLEET_QUERY_ONLY).",
)
@click.option(
    "--replicas",
    default=None,
    metavar="N|auto",
    help="Model replicas in this worker, as processes sharing the threads; auto: 1 on a CPU, "
    "sized from the host's cores on CUDA (EMBEDFLEET_REPLICAS).",
)
@verbose_option
def worker_command(
    redis_url: str | None, model: str | None, query_only: bool | None, replicas: str | None
) -> None:
    """Embed chunks from the ingest stream until SIGTERM.

    Reads {namespace}:ingest through the consumer group in bulk, embeds, writes fp16 vectors to
    {namespace}:results and acknowledges. SIGTERM or Ctrl-C drains (finishes and acknowledges
    what it holds, then exits 0); a second signal exits at once and leaves entries pending for
    other workers. Every setting comes from EMBEDFLEET_* variables (see docs/SETTINGS.md).
    """
    given = {
        "redis_url": redis_url,
        "model": model,
        "query_only": query_only,
        "replicas": replicas,
    }
    overrides = {key: value for key, value in given.items() if value}
    try:
        settings = load_settings(**overrides)
    except SettingsError as error:
        raise click.ClickException(str(error)) from None
    require_worker_extra("worker", settings.model)
    try:
        check_sink(settings)  # a bad EMBEDFLEET_SINK fails now, not after the model loads
    except (SinkURLError, MissingExtraError) as error:
        raise click.ClickException(str(error)) from None
    from embedfleet.workers.replicas import resolve_replicas  # torch only for auto on auto

    replicas_here = resolve_replicas(settings)
    if replicas_here > 1:  # a supervisor of N worker processes, each loading the model
        from embedfleet.workers.replicas import run_replicas

        as_env = {f"EMBEDFLEET_{key.upper()}": str(value) for key, value in overrides.items()}
        sys.exit(run_replicas(settings, as_env, replicas_here))
    # this process runs the model itself: one replica, whatever `auto` would size elsewhere
    settings = settings.model_copy(update={"replicas": 1})
    from embedfleet.workers.calibration import CalibrationError
    from embedfleet.workers.model.encoder import ModelNotFoundError
    from embedfleet.workers.model.model_dir import UnsupportedModelError
    from embedfleet.workers.output import OutputOptionError
    from embedfleet.workers.runtime import run_worker  # heavy imports (torch) only when running

    try:
        run_worker(settings)
    except (
        SinkSetupError,  # the database holds another model's table, or refuses our credentials
        WorkerFault,  # permanent for this worker (a setting, a CUDA error): exit 1, entries
        # are redelivered to a healthy worker
        ModelNotFoundError,
        UnsupportedModelError,  # a module or option the worker would not reproduce faithfully
        OutputOptionError,  # EMBEDFLEET_DIMENSIONS / *_PROMPT_NAME the model cannot honour
        CalibrationError,
    ) as error:
        raise click.ClickException(str(error)) from None
