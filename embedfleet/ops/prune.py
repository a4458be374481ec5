"""`embedfleet prune`: delete a re-ingested job's rows whose chunks are gone (issue 31).

A job re-ingested from a corpus that lost some chunks still has their rows in the database
sink, under the job's name (the ``job`` column: the job that last wrote the row). ``prune``
deletes the rows of ``--job`` whose ids are not in the corpus the job's latest run sent
(``--keep``: the same JSON Lines file, or a list of ids); ``embedfleet enqueue --prune`` does it
at the end of the enqueue with the ids it just sent. Rows another job wrote last stay. The
database sinks only (LanceDB, PostgreSQL + pgvector, Qdrant): Parquet shards are immutable and the
results stream is a hand-off, not a store.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Collection, Iterable, Iterator
from typing import IO, TypeVar

import click

from embedfleet.ops.waiting import json_report_option, verb_settings
from embedfleet.shared.settings import Settings
from embedfleet.sinks import (
    MissingExtraError,
    SinkURLError,
    VectorDBError,
    open_backend,
    parse_sink_url,
    prune_job,
    store_of,
)

T = TypeVar("T")
SHOWN = 20  # removed ids printed by the text view (--json lists them all)


class PruneError(click.ClickException):
    """The sink cannot be pruned (not a database, not reachable); the message says why."""


def read_ids(source: IO[bytes]) -> set[str]:
    """The ids of a JSON Lines corpus (each object's ``id``) or of a plain list, one a line.

    A line it cannot read ends it (PruneError naming the line): an id left out would be a row
    deleted."""
    ids: set[str] = set()
    for number, raw in enumerate(source, start=1):
        try:
            line = raw.decode("utf-8").strip()
        except UnicodeDecodeError as error:
            raise PruneError(
                f"--keep line {number}: not UTF-8 (byte 0x{raw[error.start]:02x} at byte "
                f"{error.start + 1})"
            ) from None
        if not line:
            continue
        if line.startswith("{"):
            try:
                value = json.loads(line).get("id")
            except (json.JSONDecodeError, AttributeError):
                value = None
            if not isinstance(value, str) or not value:
                raise PruneError(f"--keep line {number}: a JSON object without a string 'id'")
            ids.add(value)
        else:
            ids.add(line)
    return ids


class IdRecorder:
    """Passes chunks (Chunk objects or mappings) through and keeps their ids: the ids an
    enqueue sent, for ``enqueue --prune``."""

    def __init__(self) -> None:
        self.ids: set[str] = set()

    def through(self, chunks: Iterable[T]) -> Iterator[T]:
        for chunk in chunks:
            chunk_id = chunk.get("id") if isinstance(chunk, dict) else getattr(chunk, "id", None)
            if isinstance(chunk_id, str):
                self.ids.add(chunk_id)
            yield chunk


def check_database_sink(settings: Settings) -> None:
    """PruneError unless EMBEDFLEET_SINK is a database sink whose client is installed."""
    try:
        target = parse_sink_url(settings.sink, settings.sink_table, settings.s3_endpoint_url)
    except SinkURLError as error:
        raise PruneError(str(error)) from None
    if not store_of(target.kind).database:
        raise PruneError(
            f"pruning deletes rows from a database sink (LanceDB, PostgreSQL, Qdrant), and "
            f"EMBEDFLEET_SINK is {target.kind}: nothing there to delete rows from"
        )


async def prune(
    settings: Settings, job: str, keep: Collection[str], *, dry_run: bool = False
) -> list[str]:
    """Delete (or, ``dry_run``, only find) the rows of ``job`` whose ids are not in ``keep``;
    returns those ids, sorted."""
    check_database_sink(settings)
    target = parse_sink_url(settings.sink, settings.sink_table, settings.s3_endpoint_url)
    try:
        with open_backend(target, store_text=settings.store_text) as backend:
            return await asyncio.to_thread(prune_job, backend, job, keep, dry_run=dry_run)
    except (VectorDBError, MissingExtraError) as error:
        raise PruneError(str(error)) from None


def say_pruned(job: str, gone: list[str], *, dry_run: bool) -> None:
    verb = "would delete" if dry_run else "deleted"
    click.echo(f"{verb} {len(gone):,} rows of job {job!r} whose ids were not sent again")
    for chunk_id in gone[:SHOWN]:
        click.echo(f"  {chunk_id}")
    if len(gone) > SHOWN:
        click.echo(f"  ... and {len(gone) - SHOWN:,} more (--json lists all)")


@click.command("prune")
@click.option("--job", required=True, help="The re-ingested job whose removed chunks to delete.")
@click.option(
    "--keep",
    "keep_source",
    type=click.File("rb"),  # decoded a line at a time: a line not UTF-8 is named
    required=True,
    help="The ids the job's latest run sent: its JSON Lines corpus (each line's id) or a file "
    "of ids, one a line; - for stdin.",
)
@click.option("--dry-run", is_flag=True, help="Only list the rows that would be deleted.")
@json_report_option("the job, whether it was a dry run, and the ids deleted,")
def prune_command(job: str, keep_source: IO[bytes], dry_run: bool, as_json: bool) -> None:
    """Delete from the database sink the rows of --job whose ids --keep does not list.

    After a re-ingestion (the corpus enqueued again under the same job, the vector cache
    answering the unchanged chunks), the rows of chunks removed from the corpus are still in
    the table: this deletes them. Only rows whose job column is --job are touched (a row
    another job wrote last is that job's). `embedfleet enqueue --job J --prune` does the same
    at the end of the enqueue, with the ids it sent.
    """
    settings = verb_settings(None)  # the sink settings: EMBEDFLEET_SINK, EMBEDFLEET_SINK_TABLE
    keep = read_ids(keep_source)
    if not keep:
        raise PruneError("--keep lists no ids: that would delete every row of the job")
    gone = asyncio.run(prune(settings, job, keep, dry_run=dry_run))
    if as_json:
        click.echo(json.dumps({"job": job, "dry_run": dry_run, "pruned": gone}))
    else:
        say_pruned(job, gone, dry_run=dry_run)
