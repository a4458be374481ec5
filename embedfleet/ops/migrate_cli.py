"""`embedfleet migrate`: move a live vector table to another model with no downtime.

The verbs run the steps of embedfleet/ops/migration.py; each one reads the sink from EMBEDFLEET_SINK
and the table being migrated from ``--table`` (default EMBEDFLEET_SINK_TABLE), as lane A's
workers and producers have them.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from tqdm import tqdm

from embedfleet.ops import migration as mig
from embedfleet.ops.waiting import (
    client_for,
    count_option,
    input_file_option,
    json_report_option,
    redis_url_option,
    run_client,
    seconds_option,
    verb_settings,
)
from embedfleet.shared.exit_codes import ExitCode
from embedfleet.shared.logging import configure_logging
from embedfleet.shared.progress import Progress
from embedfleet.shared.settings import Settings
from embedfleet.sinks import (
    MissingExtraError,
    SinkTarget,
    SinkURLError,
    VectorDBError,
    parse_sink_url,
    store_of,
)

T = TypeVar("T")
Option = Callable[[Callable[..., Any]], Callable[..., Any]]  # what click.option(...) returns
ESTIMATE_EVERY_S = 10.0  # how often `migrate start` prints the time and tokens left

table_option = click.option(
    "--table",
    help="The table being migrated (the one lane A's workers write; default "
    "EMBEDFLEET_SINK_TABLE).",
)


def _context(redis_url: str | None, table: str | None) -> tuple[Settings, SinkTarget, str]:
    settings = verb_settings(redis_url)
    configure_logging(settings.log_level, settings.log_format)
    try:
        sink = parse_sink_url(settings.sink, settings.sink_table, settings.s3_endpoint_url)
    except SinkURLError as error:
        raise click.ClickException(str(error)) from None
    if not store_of(sink.kind).database:
        raise click.ClickException(
            "`embedfleet migrate` moves a vector database table: set EMBEDFLEET_SINK to the "
            "lancedb://, postgresql:// or qdrant:// URL the workers write to"
        )
    return settings, sink, table or settings.sink_table


def _run(settings: Settings, step: Callable[[Any], Awaitable[T]]) -> T:
    """``step(client)`` on the verb's Redis connection; the steps' errors end the verb with
    their message."""

    async def main() -> T:
        async with client_for(settings) as producer:
            return await step(producer.client)

    try:
        return run_client(main())
    except (mig.MigrationError, VectorDBError, MissingExtraError) as error:
        raise click.ClickException(str(error)) from None


def _print(report: dict[str, Any], as_json: bool, lines: list[str]) -> None:
    if as_json:
        click.echo(json.dumps(report))
    else:
        for line in lines:
            click.echo(line)


@click.group("migrate")
def migrate_group() -> None:
    """Move a live vector table to another model, with no downtime.

    \b
    1. start:    copy the stored texts into a new table, embedded by model B's lane
                 (run B's workers with EMBEDFLEET_MODEL_LANE=B EMBEDFLEET_SINK_TABLE=<new>);
                 what is written to the old table is copied to the new one from now on,
                 and both ways once the copy is verified; resumable
    2. canary:   compare search on both tables (neighbour overlap, or recall on labels)
    3. switch:   point the readers' alias at the new table in one atomic step
       rollback: point it back at the old table (it holds what lane B wrote meanwhile)
    4. finish:   stop the copies; --drop-old drops the table readers no longer use

    Readers (and `embedfleet search` with EMBEDFLEET_SINK_TABLE=<alias>) read the alias: a
    Qdrant collection alias, a PostgreSQL view, a LanceDB pointer file.
    """


def _verb(
    name: str, report: str, *options: Option
) -> Callable[[Callable[..., None]], click.Command]:
    """A verb of `migrate`, with the options they all take: ``--table`` first, then its own
    ``options``, then ``--json`` (printing ``report``) and ``--redis-url``."""

    stack: tuple[Option, ...] = (
        table_option,
        *options,
        json_report_option(report),
        redis_url_option,
    )

    def register(function: Callable[..., None]) -> click.Command:
        decorated: Callable[..., Any] = function
        for option in reversed(stack):
            decorated = option(decorated)
        return migrate_group.command(name)(decorated)

    return register


@_verb(
    "start",
    "what the copy did and measured",
    click.option("--to-table", help="The new table model B's workers write (a new migration)."),
    click.option(
        "--to-lane", help="Model B's lane: its workers run with EMBEDFLEET_MODEL_LANE=<lane>."
    ),
    click.option(
        "--alias",
        help="The reader name readers follow (default <table>_live); created pointing at the "
        "old table if missing.",
    ),
    count_option(
        "--page",
        default=mig.DEFAULT_PAGE,
        help="Rows read from the old table and enqueued at a time.",
    ),
    click.option(
        "--model",
        "model_dir",
        type=click.Path(file_okay=False, exists=True, path_type=Path),
        help="Model B's directory (its workers' EMBEDFLEET_MODEL), to count tokens with its "
        "tokenizer; without it tokens are estimated as characters / 4.",
    ),
    seconds_option(
        "--idle-timeout",
        min_open=True,
        help="Give up when lane B has not drained its queue after this many seconds "
        "(default: wait).",
    ),
)
def start_command(
    table: str | None,
    to_table: str | None,
    to_lane: str | None,
    alias: str | None,
    page: int,
    model_dir: Path | None,
    idle_timeout: float | None,
    as_json: bool,
    redis_url: str | None,
) -> None:
    """Start the migration of the table to model B, or resume it: the same command again (or
    without options) continues from the recorded cursor after a crash or Ctrl-C.

    Turns the dual write on (sinks of the old table enqueue what they write to lane B too),
    enqueues every stored text to lane B page by page, waits until lane B has embedded them,
    then checks that the new table holds every id with its text and sends again what it does
    not; once verified, the sinks of the new table copy what they write to lane A too. Shows
    progress, the measured rows/s and tokens/s, the time left and the tokens in all. Exit
    status 1 when the copy could not be verified.
    """
    settings, sink, source = _context(redis_url, table)

    async def step(client: Any) -> tuple[mig.Migration, mig.CopyReport]:
        migration = await mig.start(
            settings, client, sink, source=source, target=to_table, target_lane=to_lane, alias=alias
        )
        return migration, await _copy_shown(migration, client, page, model_dir, idle_timeout)

    migration, report = _run(settings, step)
    summary = {**migration.as_dict(), **report.as_dict()}
    _print(summary, as_json, _copy_said(migration, report))
    if not report.verified:
        sys.exit(ExitCode.ERROR)


async def _copy_shown(
    migration: mig.Migration,
    client: Any,
    page: int,
    model_dir: Path | None,
    idle_timeout: float | None,
) -> mig.CopyReport:
    """The copy, with a progress bar and the estimate said every ``ESTIMATE_EVERY_S``."""
    with Progress("migrate", "rows") as bar:
        said = [time.monotonic()]

        def show(estimate: mig.Estimate) -> None:
            bar.set(estimate.done, total=estimate.total)
            if time.monotonic() - said[0] >= ESTIMATE_EVERY_S:  # above the bar, or logged
                said[0] = time.monotonic()
                tqdm.write(estimate.describe(), file=sys.stderr)

        return await mig.copy(
            migration,
            client,
            page=page,
            model_dir=model_dir,
            on_progress=show,
            idle_timeout_s=idle_timeout,
        )


def _copy_said(migration: mig.Migration, report: mig.CopyReport) -> list[str]:
    """The text report of a copy: its figures and, verified or not, what to do next."""
    return [
        f"{migration.source!r} -> {migration.target!r} (lane {migration.target_lane}): "
        f"{report.in_target:,} of {report.total:,} rows, {report.enqueued:,} enqueued by this "
        f"run, {report.resent:,} sent again, {report.seconds:.1f} s",
        f"measured {report.rows_per_s:,.1f} rows/s, about {report.tokens:,} tokens "
        f"({report.tokens_per_row:.1f} a row, {report.tokens_measured})",
        "verified: every id is in the new table with its text; next: embedfleet migrate "
        "canary, then embedfleet migrate switch"
        if report.verified
        else f"NOT verified: {report.missing:,} rows still missing or different; run "
        "`embedfleet migrate start` again",
    ]


@_verb("status", "the migration's record, progress and estimate")
def migrate_status_command(table: str | None, as_json: bool, redis_url: str | None) -> None:
    """Show a migration: its tables and lanes, where the alias points, whether the dual write
    is on, and the copy's progress with the time left at the last measured rate."""
    settings, sink, source = _context(redis_url, table)

    async def step(client: Any) -> tuple[mig.Migration, mig.Estimate, str]:
        migration = await mig.load(settings, client, sink, source)
        with migration.backend(migration.alias) as reader:
            reading = reader.resolve()
        return migration, await mig.estimate(migration), reading

    migration, estimate, reading = _run(settings, step)
    report = {**migration.as_dict(), "alias_points_at": reading, **estimate.as_dict()}
    _print(
        report,
        as_json,
        [
            f"{source!r} -> {migration.target!r} (lane {migration.target_lane}), state "
            f"{report['state']}, dual write {'on' if report['dual_write'] else 'off'}",
            f"written: {migration.describe_copies()}",
            f"readers: alias {migration.alias!r} -> {reading!r}",
            estimate.describe(),
        ],
    )


@_verb(
    "canary",
    "the scores (and each query's neighbours)",
    input_file_option(
        "--queries",
        required=True,
        help='One query per line: text, or {"query": ..., "relevant": [ids]} for recall@k.',
    ),
    count_option("--k", default=10, maximum=1000),
    click.option(
        "--min-overlap",
        type=click.FloatRange(0, 1),
        default=None,
        help="Exit status 1 when the mean overlap@k is below this.",
    ),
    click.option(
        "--min-recall",
        type=click.FloatRange(0, 1),
        default=None,
        help="Exit status 1 when the new table's mean recall@k is below this (labelled queries).",
    ),
    click.option("--timeout", type=float, default=30.0, show_default=True, help="Per query batch."),
)
def canary_command(
    table: str | None,
    queries: Path,
    k: int,
    min_overlap: float | None,
    min_recall: float | None,
    timeout: float,
    as_json: bool,
    redis_url: str | None,
) -> None:
    """Search the old and the new table for each query, each embedded by its own model, and
    compare: the mean neighbour overlap@k (|A's top k ∩ B's top k| / k) and, for labelled
    queries, each table's mean recall@k."""
    settings, sink, source = _context(redis_url, table)
    try:
        asked = mig.read_queries(queries)
    except mig.MigrationError as error:
        raise click.ClickException(str(error)) from None

    async def step(client: Any) -> mig.CanaryReport:
        migration = await mig.load(settings, client, sink, source)
        return await mig.canary(migration, client, asked, k=k, timeout=timeout)

    report = _run(settings, step)
    lines = [f"{report.queries} queries, overlap@{k} {report.overlap:.3f}"]
    if report.recall_source is not None and report.recall_target is not None:
        lines.append(
            f"recall@{k}: old table {report.recall_source:.3f}, new table "
            f"{report.recall_target:.3f}"
        )
    _print(report.as_dict(), as_json, lines)
    if min_overlap is not None and report.overlap < min_overlap:
        click.echo(
            f"overlap@{k} {report.overlap:.3f} is under --min-overlap {min_overlap}", err=True
        )
        sys.exit(ExitCode.ERROR)
    if min_recall is not None and (report.recall_target or 0.0) < min_recall:
        click.echo(f"the new table's recall@{k} is under --min-recall {min_recall}", err=True)
        sys.exit(ExitCode.ERROR)


def _point(to: str, table: str | None, force: bool, as_json: bool, redis_url: str | None) -> None:
    settings, sink, source = _context(redis_url, table)

    async def step(client: Any) -> tuple[mig.Migration, str, int]:
        migration = await mig.load(settings, client, sink, source)
        pointed = await mig.point_readers(migration, client, to, force=force)
        lane = migration.target_lane if to == "target" else migration.source_lane
        return migration, pointed, await mig.queued(client, settings.keys.for_model(lane))

    migration, pointed, waiting = _run(settings, step)
    lane = (migration.target_lane if to == "target" else migration.source_lane) or "default"
    _print(
        {**migration.as_dict(), "alias_points_at": pointed, "queued": waiting},
        as_json,
        [
            f"alias {migration.alias!r} -> {pointed!r}",
            f"written: {migration.describe_copies()}",
            f"lane {lane} has {waiting:,} entries queued (copies of the other lane's writes among "
            f"them): they are searchable in {pointed!r} once its workers embed them",
        ],
    )


@_verb(
    "switch",
    "where the alias points now",
    click.option("--force", is_flag=True, help="Switch even though the copy is not verified."),
)
def switch_command(table: str | None, force: bool, as_json: bool, redis_url: str | None) -> None:
    """Point the readers' alias at the new table, in one atomic step (Qdrant: one alias
    request; PostgreSQL: the view replaced in one transaction; LanceDB: the pointer file
    replaced by one rename). The old table stays, and stays written (what lane B writes is
    copied to lane A until `finish`): `rollback` goes back and loses nothing."""
    _point("target", table, force, as_json, redis_url)


@_verb("rollback", "where the alias points now")
def rollback_command(table: str | None, as_json: bool, redis_url: str | None) -> None:
    """Point the readers' alias back at the old table, in one atomic step. It holds what was
    written through lane B since the switch: the sinks of the new table copy it to lane A until
    `finish` (what lane A has not embedded yet is queued in its stream)."""
    _point("source", table, True, as_json, redis_url)


@_verb(
    "finish",
    "what was ended and dropped",
    click.option(
        "--drop-old", is_flag=True, help="Also drop the table the alias does not point at."
    ),
)
def finish_command(table: str | None, drop_old: bool, as_json: bool, redis_url: str | None) -> None:
    """End the migration: the sinks of each table stop copying to the other model's lane. The
    table readers do not use is kept unless --drop-old. Move your producers to the lane the
    alias reads (EMBEDFLEET_MODEL_LANE / the chunk's model) before."""
    settings, sink, source = _context(redis_url, table)

    async def step(client: Any) -> tuple[mig.Migration, str | None]:
        migration = await mig.load(settings, client, sink, source)
        return migration, await mig.finish(migration, client, drop_old=drop_old)

    migration, dropped = _run(settings, step)
    _print(
        {**migration.as_dict(), "dropped": dropped},
        as_json,
        [
            "dual write off, both ways: each lane writes only its own table"
            + (f"; dropped {dropped!r}" if dropped else "; both tables kept (--drop-old drops)")
        ],
    )
