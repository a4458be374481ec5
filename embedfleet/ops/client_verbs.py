"""`embedfleet enqueue`, `results`, `query` and `calibration`: the verbs of the client."""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import signal
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import click
import numpy as np

from embedfleet.ops.export import (
    SUPPORTED_SUFFIXES,
    ExportFileError,
    ExportWriter,
    write_export,
)
from embedfleet.ops.prune import IdRecorder, check_database_sink, say_pruned
from embedfleet.ops.prune import prune as prune_rows
from embedfleet.ops.waiting import (
    client_for,
    count_option,
    json_report_option,
    model_option,
    redis_url_option,
    run_client,
    seconds_option,
    verb_settings,
)
from embedfleet.producer.client import (
    EmbeddingOptions,
    Producer,
    QueryTimeoutError,
    TenantBacklogFullError,
)
from embedfleet.producer.enqueue import Enqueued
from embedfleet.producer.images import IMAGE_SUFFIXES, BadFile, folder_chunks, image_files
from embedfleet.producer.jsonl import BadLine, read_chunks
from embedfleet.producer.results_reader import export_reader_name
from embedfleet.producer.token_ids import TokenIdsUnavailableError
from embedfleet.shared.exit_codes import ExitCode
from embedfleet.shared.jobs import JobProgress
from embedfleet.shared.keys import Keys
from embedfleet.shared.logging import configure_logging
from embedfleet.shared.options import verify
from embedfleet.shared.progress import Progress
from embedfleet.shared.protocol import Chunk, QueryFailedError, Result
from embedfleet.shared.settings import Settings
from embedfleet.shared.tenants import check_tenant
from embedfleet.sinks import (
    MissingExtraError,
    SinkURLError,
    VectorDBError,
    open_backend,
    parse_sink_url,
)

# the image files --images reads, named in its messages
NAMES = "/".join(IMAGE_SUFFIXES)


def _settings(redis_url: str | None) -> Settings:
    settings = verb_settings(redis_url)
    configure_logging(settings.log_level, settings.log_format)
    return settings


@click.command("enqueue")
@click.argument("sources", nargs=-1, required=True)
@click.option("--job", help="Job name to group these chunks (default: generated and printed).")
@click.option(
    "--documents",
    is_flag=True,
    help="SOURCES are whole documents (.txt/.md files, or JSONL of {id, text, meta}): split "
    "with the model's own tokenizer into chunks that fit it, ids <doc>#<n>. Needs "
    "pip install 'embedfleet[documents]'.",
)
@click.option(
    "--images",
    is_flag=True,
    help="SOURCES are folders of images (JPEG, PNG, WebP, GIF, by their names' endings), for "
    "a CLIP or SigLIP lane: each file under them is one chunk, its id the path relative to its "
    "folder, its image_ref (what a database row stores in place of a text) the file's path. A "
    "file unreadable or over EMBEDFLEET_MAX_IMAGE_BYTES is reported and not sent (exit status "
    "4); one that does not decode is dead-lettered by the worker. A JSON line's own "
    '"image_ref" (default: its image_path) is stored likewise.',
)
@count_option(
    "--overlap",
    minimum=0,
    help="With --documents: tokens shared by consecutive chunks "
    "(default EMBEDFLEET_DOCUMENT_OVERLAP_TOKENS).",
)
@click.option(
    "--force",
    is_flag=True,
    help="Add every chunk, also those the job already has with the same text (a job remembers "
    "its ids for EMBEDFLEET_JOB_IDS_TTL_S and skips them): to embed them again, say after "
    "their vectors' table was wiped.",
)
@click.option(
    "--tenant",
    default=None,
    help="The tenant these chunks are accounted to and share the fleet as (its own streams, "
    "read by its EMBEDFLEET_TENANT_WEIGHTS weight); default: what EMBEDFLEET_TENANT_MAP says "
    'for the job, else EMBEDFLEET_DEFAULT_TENANT. A line\'s own "tenant" wins.',
)
@click.option(
    "--reembed",
    is_flag=True,
    help="Run the model for every chunk, even those whose vector the workers' vector cache "
    "holds (same text, model revision and options). Not --force: --force re-sends ids the job "
    "already has, and the cache may still answer them.",
)
@count_option(
    "--window-overlap",
    minimum=0,
    help="Embed each text over the model's maximum tokens whole, not cut: in token windows of "
    "the model's length sharing N tokens with their neighbour, pooled back into one vector "
    "(the chunk field window_overlap; a line's own wins). Dense models only.",
)
@click.option(
    "--token-ids/--no-token-ids",
    "token_ids",
    default=None,
    help="Tokenize here and send each chunk's token ids, made with the tokenizer the workers "
    "publish, so the workers do not tokenize (a GPU host's cores feed the GPU). Needs "
    "embedfleet[documents] and a worker that has started once. Default: "
    "EMBEDFLEET_PRODUCER_TOKEN_IDS.",
)
@click.option(
    "--prune",
    is_flag=True,
    help="With --job, once SOURCE is sent: delete from the database sink the rows of this job "
    "whose ids SOURCE no longer has (chunks removed since the job's last run). Refused when "
    "lines were rejected (their rows would go too). See also: embedfleet prune.",
)
@click.option("--wait", is_flag=True, help="Wait until every chunk is embedded or dead-lettered.")
@click.option("--timeout", type=float, default=None, help="With --wait: give up after N seconds.")
@json_report_option(
    "the job, the chunks enqueued, those already in the job and, with --wait, how they ended,"
)
@model_option
@redis_url_option
def enqueue_command(
    sources: tuple[str, ...],
    job: str | None,
    documents: bool,
    images: bool,
    overlap: int | None,
    force: bool,
    tenant: str | None,
    reembed: bool,
    window_overlap: int | None,
    token_ids: bool | None,
    prune: bool,
    wait: bool,
    timeout: float | None,
    as_json: bool,
    model: str | None,
    redis_url: str | None,
) -> None:
    """Enqueue chunks from SOURCE, a JSON Lines file or - for stdin (or documents, see
    --documents; or folders of images, see --images).

    One object per line: {"id": "doc1#0", "text": "...", "meta": {...}}. The id is your
    idempotency key (re-sending it overwrites, never duplicates); meta is passed through to the
    results. Bad lines (not UTF-8, not JSON, not a valid chunk, an option the served model does
    not have, longer than 6 x EMBEDFLEET_MAX_MESSAGE_BYTES) are reported with their line numbers
    and not enqueued; every good line is (exit status 4).

    Images (a CLIP or SigLIP lane): a line's "image" (base64, a data URI) or "image_path" (a
    file, from the JSON Lines file's folder) in place of "text"; folders of them: --images.

    With --documents, each SOURCE is a whole document (text or Markdown file; its path is its
    id) or a JSONL file of documents; every chunk carries the document's meta plus doc, n and
    the character offsets start/end.

    A job skips the chunks it already has (same id, same text and meta): re-running an enqueue
    adds nothing, and says so. --force adds them again.

    --model sends the chunks (and their job) to that model's streams, where the namespace
    serves several models; a name no worker registered is refused before anything is sent.

    Re-ingesting a corpus: enqueue it again under its job. The workers' vector cache answers the
    chunks whose text and options have not changed (no model runs for them; --reembed turns
    that off), and --prune deletes the rows of the chunks the corpus no longer has.
    """
    _check_enqueue_options(wait, timeout, documents, images, overlap, prune, job)
    job, settings = _job_and_settings(job, redis_url, tenant, prune)
    run = _Run(
        force=force,
        reembed=reembed,
        wait=wait,
        timeout=timeout,
        sent=IdRecorder(),
        model=model,
        tenant=tenant,
        window_overlap=window_overlap,
        token_ids=token_ids,
    )
    kind = "documents" if documents else "images" if images else "jsonl"
    _enqueue_and_report(settings, sources, job, run, kind, overlap, prune, as_json)


def _enqueue_and_report(
    settings: Settings,
    sources: tuple[str, ...],
    job: str,
    run: _Run,
    kind: str,
    overlap: int | None,
    prune: bool,
    as_json: bool,
) -> None:
    """The checked enqueue, run: its chunks sent, --prune applied, the report and exit status.
    ``kind``: what SOURCES are, "jsonl", "documents" or "images" (folders)."""
    dead: list[int] = []  # the dead-lettered count, once --wait has seen the job finish
    rejected: list[BadLine | BadFile] = []
    documents = kind == "documents"
    if documents:
        count = run_client(_enqueue_documents(settings, sources, job, overlap, run, rejected, dead))
    elif kind == "images":
        folders = _image_folders(sources)  # walked before the client starts
        count = run_client(_enqueue_images(settings, folders, job, run, rejected, dead))
    else:
        count = _enqueue_jsonl(settings, sources, job, run, rejected, dead)
    pruned: list[str] | None = None
    if prune and not rejected:
        pruned = asyncio.run(prune_rows(settings, job, run.sent.ids))
    if as_json:
        _report_enqueue(job, count, rejected, dead, run.model, pruned)
    else:
        _say_enqueued(job, count, len(sources) if documents else None, pruned)
    _say_rejected(rejected, prune)
    _exit_for(dead, rejected)


def _check_enqueue_options(
    wait: bool,
    timeout: float | None,
    documents: bool,
    images: bool,
    overlap: int | None,
    prune: bool,
    job: str | None,
) -> None:
    """The options that apply only with another one: a usage error naming what is missing."""
    if timeout is not None and not wait:
        raise click.UsageError("--timeout applies only with --wait")
    if documents and images:
        raise click.UsageError("--documents and --images: SOURCES are one or the other")
    if overlap is not None and not documents:
        raise click.UsageError("--overlap applies only with --documents")
    if prune and not job:
        raise click.UsageError("--prune needs --job: the job whose earlier rows to compare with")


def _job_and_settings(
    job: str | None, redis_url: str | None, tenant: str | None, prune: bool
) -> tuple[str, Settings]:
    """The job's name (given, or made from the time) and the settings, --tenant and --prune
    checked before anything is sent."""
    settings = _settings(redis_url)
    if tenant is not None:
        _check_tenant_option(tenant)
    if prune:
        check_database_sink(settings)
    return job or f"job-{time.strftime('%Y%m%d-%H%M%S')}", settings


def _check_tenant_option(tenant: str) -> None:
    """--tenant's name, as the tenants policy accepts names (a bad one is a bad parameter)."""
    try:
        check_tenant(tenant, "--tenant")
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--tenant") from None


def _enqueue_jsonl(
    settings: Settings,
    sources: tuple[str, ...],
    job: str,
    run: _Run,
    rejected: list[BadLine | BadFile],
    dead: list[int],
) -> Enqueued:
    """The one JSON Lines SOURCE (a file, or - for stdin), opened and enqueued."""
    if len(sources) != 1:
        raise click.UsageError("give one JSON Lines SOURCE (or --documents for several files)")
    try:
        # bytes: the reader decodes each line itself, so a line not UTF-8 is a bad line
        opened = click.open_file(sources[0], "rb")
    except OSError as error:
        raise click.BadParameter(
            f"{sources[0]}: {error.strerror or error}", param_hint="SOURCES"
        ) from None
    # a line's relative image_path is read from the file's folder (stdin's: this one)
    base = Path() if sources[0] == "-" else Path(sources[0]).parent
    with opened as source:
        return run_client(_enqueue(settings, (source, base), job, run, rejected, dead))


def _say_enqueued(
    job: str, count: Enqueued, documents: int | None, pruned: list[str] | None
) -> None:
    """The text report: what was enqueued (``documents``: how many sources, with
    --documents), what the job already had, and with --prune what was deleted."""
    sources_said = f" of {documents} sources" if documents is not None else ""
    click.echo(f"enqueued {_counted(count)} chunks{sources_said} as job {job!r}")
    _say_present(count, job)
    if pruned is not None:
        say_pruned(job, pruned, dry_run=False)


def _say_rejected(rejected: list[BadLine | BadFile], prune: bool) -> None:
    """The first 20 rejected lines (or files) and their count, on stderr; why --prune did not
    run."""
    for bad in rejected[:20]:
        where = bad.path if isinstance(bad, BadFile) else f"line {bad.line_number}"
        click.echo(f"{where}: {bad.reason}", err=True)
    if rejected:
        what = "files" if isinstance(rejected[0], BadFile) else "lines"
        click.echo(f"{len(rejected)} {what} rejected, not enqueued", err=True)
        if prune:
            click.echo(
                f"not pruned: the rejected {what}' ids were not sent, and their rows would have "
                "been deleted; fix the lines and enqueue again with --prune",
                err=True,
            )


def _exit_for(dead: list[int], rejected: list[BadLine | BadFile]) -> None:
    """The exit status of an enqueue: dead letters (--wait saw some) before rejected lines."""
    if any(dead):
        sys.exit(ExitCode.DEAD_LETTERS)
    if rejected:
        sys.exit(ExitCode.REJECTED_LINES)


@dataclass(frozen=True)
class _Run:
    """How one enqueue call sends its chunks."""

    force: bool
    reembed: bool
    wait: bool
    timeout: float | None
    sent: IdRecorder  # the ids sent, for --prune
    model: str | None = None  # the model lane the chunks go to (None: the settings')
    tenant: str | None = None  # the tenant they are accounted to (None: the tenant map's)
    # long inputs embedded whole in windows sharing this many tokens (None: cut or refused)
    window_overlap: int | None = None
    # send token ids made here (None: EMBEDFLEET_PRODUCER_TOKEN_IDS)
    token_ids: bool | None = None


def _counted(count: Enqueued) -> str:
    """``30``, or ``0 of 30`` when some chunks were already in the job."""
    return f"{int(count)} of {count.chunks}" if count.present else str(int(count))


def _say_present(count: Enqueued, job: str) -> None:
    if count.present:
        click.echo(
            f"{count.present} chunks were already in job {job!r} with the same text and were "
            "not added again (a job remembers its ids for EMBEDFLEET_JOB_IDS_TTL_S). To embed "
            "them again, say after their table was wiped: the same enqueue with --force",
            err=True,
        )


def _report_enqueue(
    job: str,
    count: Enqueued,
    rejected: list[BadLine | BadFile],
    dead: list[int],
    model: str | None,
    pruned: list[str] | None = None,
) -> None:
    report: dict[str, object] = {
        "job": job,
        "model": model,
        "enqueued": int(count),
        "already_present": count.present,
        "rejected_lines": [
            {"line": bad.line_number, "reason": bad.reason}
            for bad in rejected
            if isinstance(bad, BadLine)
        ],
    }
    if any(isinstance(bad, BadFile) for bad in rejected):  # --images
        report["rejected_files"] = [
            {"file": bad.path, "reason": bad.reason} for bad in rejected if isinstance(bad, BadFile)
        ]
    if dead:  # --wait saw the job end
        report["dead_lettered"] = dead[0]
    if pruned is not None:  # --prune: the ids whose rows were deleted
        report["pruned"] = pruned
    click.echo(json.dumps(report))


async def _enqueue(
    settings: Settings,
    # click.open_file: a file, or stdin for "-"; the folder its lines' image_path start from
    source: tuple[IO[bytes], Path],
    job: str,
    run: _Run,
    rejected: list[BadLine | BadFile],
    dead: list[int],
) -> Enqueued:
    async with client_for(settings, run.model) as producer:
        # the options verifier, per line, against the served model's card: a line it refuses
        # (an unknown prompt_name) is a bad line, and the lines around it are still enqueued
        card = await producer.model_card()
        check = None if card is None else functools.partial(verify, card=card)
        lines: list[BadLine] = []  # read_chunks' own, added to ``rejected`` once read
        chunks = read_chunks(source[0], job, lines, settings.chunk_limits, check, source[1])
        count = await _send(
            producer,
            chunks,
            run,
            options=EmbeddingOptions(window_overlap=run.window_overlap),
            token_ids=run.token_ids,
        )
        rejected.extend(lines)
        await _wait_if_asked(producer, job, run, count, dead)
    return count


async def _send(
    producer: Producer,
    chunks: Iterable[Chunk],
    run: _Run,
    progress: Progress | None = None,
    **enqueue_options: Any,
) -> Enqueued:
    """``chunks`` enqueued as ``run`` says, with a progress bar of chunks (or ``progress``);
    a refusal of the producer's (a tenant's backlog full, no token ids) is the command's
    error."""
    with progress or Progress("enqueue", "chunks") as bar:
        try:
            return await producer.enqueue(
                run.sent.through(chunks),
                on_batch=bar.update,
                force=run.force,
                reembed=run.reembed,
                tenant=run.tenant,
                **enqueue_options,
            )
        except (ValueError, TenantBacklogFullError, TokenIdsUnavailableError) as error:
            # ValueError: a model card published after the reader's (a worker's first
            # start) refused a chunk; the chunks before it were enqueued
            raise click.ClickException(str(error)) from None


async def _wait_if_asked(
    producer: Producer, job: str, run: _Run, count: Enqueued, dead: list[int]
) -> None:
    """With --wait: the job waited for, with a bar, and its dead-lettered count in ``dead``."""
    if run.wait and count.chunks:  # chunks already in the job may still be on their way
        dead.append((await _wait_with_bar(producer, job, count.chunks, run.timeout)).dead)


def _image_folders(sources: tuple[str, ...]) -> list[tuple[Path, list[Path]]]:
    """Each folder of ``sources`` with its image files (producer/images.py ``image_files``);
    the files not named as images counted on stderr, a folder missing or without any image
    the command's error."""
    folders = [Path(source) for source in sources]
    for folder in folders:
        if not folder.is_dir():
            raise click.BadParameter(f"{folder} is not a folder", param_hint="SOURCES")
    listed = [(folder, image_files(folder)) for folder in folders]
    if others := sum(count for _, (_, count) in listed):
        click.echo(f"skipped {others} files not named as images ({NAMES})", err=True)
    if not any(files for _, (files, _) in listed):
        raise click.ClickException(f"no image files ({NAMES}) under {', '.join(sources)}")
    return [(folder, files) for folder, (files, _) in listed]


async def _enqueue_images(
    settings: Settings,
    folders: list[tuple[Path, list[Path]]],
    job: str,
    run: _Run,
    rejected: list[BadLine | BadFile],
    dead: list[int],
) -> Enqueued:
    """The image files of ``folders``, one chunk each, read as they are sent
    (producer/images.py ``folder_chunks``); a file refused goes to ``rejected``."""
    total = sum(len(files) for _, files in folders)
    async with client_for(settings, run.model) as producer:
        card = await producer.model_card()  # a text-only lane refuses each image, with why
        check = None if card is None else functools.partial(verify, card=card)
        bad: list[BadFile] = []
        limits = settings.chunk_limits
        chunks = itertools.chain.from_iterable(
            folder_chunks(folder, files, job, bad, limits, check) for folder, files in folders
        )
        # (a batch is sent at 96 MiB of images: producer/enqueuer.py BATCH_IMAGE_BYTES)
        count = await _send(producer, chunks, run, Progress("enqueue", "images", total=total))
        rejected.extend(bad)
        await _wait_if_asked(producer, job, run, count, dead)
    return count


async def _enqueue_documents(
    settings: Settings,
    sources: tuple[str, ...],
    job: str,
    overlap: int | None,
    run: _Run,
    rejected: list[BadLine | BadFile],
    dead: list[int],
) -> Enqueued:
    from embedfleet.producer.documents import read_documents

    def reject(line_number: int, reason: str) -> None:
        rejected.append(BadLine(line_number, reason))

    paths = [Path(source) for source in sources]
    for path in paths:
        if not path.is_file():
            raise click.BadParameter(f"{path} is not a file", param_hint="SOURCES")
    async with client_for(settings, run.model) as producer:
        await producer.model_card()  # the published maximum and prompts, where a worker ran
        try:
            splitter = producer.document_splitter(overlap)
        except (ImportError, ValueError) as error:
            raise click.ClickException(str(error)) from None
        chunks = splitter.split_all(read_documents(paths, reject), job)
        count = await _send(producer, chunks, run, job=job, token_ids=run.token_ids)
        await _wait_if_asked(producer, job, run, count, dead)
    return count


async def _wait_with_bar(
    producer: Producer, job: str, total: int, timeout: float | None
) -> JobProgress:
    with Progress("embedded", "chunks", total=total) as bar:

        def update(progress: JobProgress) -> None:
            bar.set(progress.done + progress.dead, total=progress.enqueued)

        progress = await producer.wait_for_job(job, timeout=timeout, on_progress=update)
    if progress.dead:
        click.echo(
            f"{progress.dead} chunks dead-lettered; see them with: embedfleet dead list --job "
            f"{job} (replay them once fixed: embedfleet dead replay --job {job})",
            err=True,
        )
    return progress


@click.command("results")
@click.option("--job", help="Only this job's results (not with --consume).")
@click.option(
    "--out",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Output file: .npz (arrays ids, vectors fp16) or .jsonl ({id, vector}), written a "
    "page at a time. With --consume it is never overwritten: a .jsonl is appended to, a killed "
    "run's .npz is finished by the next run, and an existing .npz is refused.",
)
@click.option(
    "--consume",
    is_flag=True,
    help="Redis sink: drain the results streams: each page is written and fsynced, then "
    "acknowledged and deleted; several readers share the work, and a crashed reader's page is "
    "claimed by another after EMBEDFLEET_RESULTS_CLAIM_IDLE_MS (by the same command run again "
    "at once). Ends once nothing is left on the streams.",
)
@click.option(
    "--follow",
    is_flag=True,
    help="With --consume: keep draining as results arrive, until SIGTERM or Ctrl-C (then the "
    "file is finished with every page taken).",
)
@count_option("--page", default=1000, help="Results read, held and written at a time.")
@json_report_option("what was written, and from where,")
@model_option
@redis_url_option
def results_command(
    job: str | None,
    out: Path,
    consume: bool,
    follow: bool,
    page: int,
    as_json: bool,
    model: str | None,
    redis_url: str | None,
) -> None:
    """Export vectors from wherever the workers write them (EMBEDFLEET_SINK), a page at a time:
    the export holds one page in memory, not the job.

    The Redis sink: the results streams in stream order, read, or with --consume drained (read,
    written, acknowledged and deleted). A chunk enqueued twice has its id twice; keep the last.
    --model reads that model's results streams, where the namespace serves several.
    A vector database (lancedb://, postgresql://, qdrant://): its rows, one per id.

    A consuming export's file is the only copy of what it took: it is added to, never
    overwritten. Killed, run the same command again: it appends after the whole pages (cutting
    a torn last line), takes back at once the page the killed run held, and drains the rest;
    every result ends in the file at least once. An .npz is finished from the killed run's .part
    files; a finished .npz is refused (give each run its own file).
    """
    if out.suffix.lower() not in SUPPORTED_SUFFIXES:
        raise click.BadParameter("must end in .npz or .jsonl", param_hint="--out")
    if follow and not consume:
        raise click.UsageError("--follow applies only with --consume")
    if consume and job is not None:
        raise click.UsageError(
            "--consume drains every job's results; export one job without --consume"
        )
    settings = _settings(redis_url)
    try:
        count, earlier, where = _export(settings, out, job, page, consume, follow, model)
    except (SinkURLError, VectorDBError, MissingExtraError, ExportFileError) as error:
        raise click.ClickException(str(error)) from None
    if as_json:
        report = {"vectors": count, "earlier": earlier, "source": where, "out": str(out)}
        click.echo(json.dumps(report))
    else:
        after = f" (after the {earlier} an earlier run wrote there)" if earlier else ""
        click.echo(f"wrote {count} vectors from {where} to {out}{after}")


def _export(
    settings: Settings,
    out: Path,
    job: str | None,
    page: int,
    consume: bool,
    follow: bool,
    model: str | None,
) -> tuple[int, int, str]:
    """The export, from the settings' sink: (vectors written, those an earlier run wrote, where
    from). The Redis sink's streams, or a database sink's rows (neither --consume nor --model)."""
    target = parse_sink_url(settings.sink, settings.sink_table, settings.s3_endpoint_url)
    if target.kind == "redis":
        # consuming: what the file holds was deleted from Redis: keep it, add to it
        with ExportWriter(out, resume=consume) as writer:
            keys = run_client(_export_stream(settings, writer, job, page, consume, follow, model))
        streams = ", ".join(p.results for p in keys.partitions_keys)
        return writer.count, writer.earlier, f"the results stream {streams}"
    if consume:
        raise click.UsageError("--consume applies to the Redis sink's results streams")
    if model is not None:
        raise click.UsageError(
            "--model picks a model's results streams (the Redis sink); a database "
            "sink's table is EMBEDFLEET_SINK_TABLE's"
        )
    with open_backend(target) as backend:
        count = write_export(backend.export_rows(job), out, page)
    return count, 0, target.describe()


async def _export_stream(
    settings: Settings,
    writer: ExportWriter,
    job: str | None,
    page: int,
    consume: bool,
    follow: bool = False,
    model: str | None = None,
) -> Keys:
    """The results streams (``model``'s lane's, else the settings') into ``writer``, one page
    held at a time; with ``consume`` each page is acknowledged (and deleted) only once written
    and fsynced, by a reader named after the file (a re-run takes back what a killed run held);
    with ``follow`` until SIGTERM or SIGINT, which end it between pages. Returns the lane's
    keys."""
    stop = asyncio.Event()
    if follow:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
    async with client_for(settings, model) as producer:
        with Progress("read results", "results") as bar:
            if consume:
                reader = producer.results_reader(page=page, consumer=export_reader_name(writer.out))
                try:
                    while (taken := await reader.next_page(follow=follow, stop=stop)) is not None:
                        # on disk, then acked; the entries: a page taken back after a kill
                        # before its ack is not written twice (embedfleet/ops/export.py)
                        entries = (taken.partition.results, taken.entry_ids)
                        writer.write(taken.results, durable=True, entries=entries)
                        await reader.acknowledge(taken)
                        bar.update(len(taken.results))
                finally:
                    await reader.close()
                return producer.keys
            batch: list[Result] = []
            async for result in producer.results(job=job, page=page):
                batch.append(result)
                if len(batch) >= page:
                    writer.write(batch)
                    bar.update(len(batch))
                    batch = []
            writer.write(batch)
            bar.update(len(batch))
    return producer.keys


@click.command("query")
@click.argument("text")
@seconds_option(
    "--timeout", min_open=True, default=10.0, help="Seconds to wait for a worker's answer."
)
@click.option("--json", "as_json", is_flag=True, help="Print the vector as a JSON list.")
@model_option
@redis_url_option
def query_command(
    text: str, timeout: float, as_json: bool, model: str | None, redis_url: str | None
) -> None:
    """Embed TEXT now through the query stream, ahead of any bulk backlog.

    Workers look at the query stream before every bulk batch and between transformer layers,
    so a query waits for at most one slice of bulk compute (EMBEDFLEET_SLICE_MS). --model asks
    that model's workers, where the namespace serves several.
    """
    settings = _settings(redis_url)
    started = time.perf_counter()
    try:
        vector = run_client(_query(settings, text, timeout, model))
    except QueryTimeoutError as error:
        raise click.ClickException(str(error)) from None
    except QueryFailedError as error:
        raise click.ClickException(f"the worker rejected the query: {error}") from None
    except ValueError as error:  # the protocol's refusal: empty, too long, not valid Unicode
        raise click.BadParameter(str(error), param_hint="TEXT") from None
    elapsed_ms = (time.perf_counter() - started) * 1000
    if as_json:
        click.echo(
            json.dumps(
                {
                    "text": text,
                    "model": model,
                    "dim": int(vector.shape[0]),
                    "vector": [round(float(v), 6) for v in vector],
                }
            )
        )
    else:
        preview = ", ".join(f"{v:+.4f}" for v in vector[:6])
        click.echo(f"dim {vector.shape[0]}, {elapsed_ms:.0f} ms round trip: [{preview}, ...]")


async def _query(
    settings: Settings, text: str, timeout: float, model: str | None = None
) -> np.ndarray:
    # Not `async with`: its set-up would wait for Redis for EMBEDFLEET_REDIS_RETRY_S, while a
    # query waits no longer than its --timeout (embed_query sets up within it).
    producer = client_for(settings)
    try:
        return await producer.embed_query(text, timeout=timeout, model=model)
    finally:
        await producer.close()


@click.command("calibration")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the stored calibrations as JSON (a file EMBEDFLEET_CALIBRATION_FILE accepts).",
)
@redis_url_option
def calibration_command(as_json: bool, redis_url: str | None) -> None:
    """Show the int8/uint8 calibration ranges the workers share.

    One per model and dimension variant, stored at {namespace}:calibration:<model>:<variant> by
    the first worker that needed it (or from EMBEDFLEET_CALIBRATION_FILE). Every worker
    quantizes with these, so a text gets the same bytes everywhere, every day.
    """
    settings = _settings(redis_url)
    entries = run_client(_calibrations(settings))
    if as_json:
        click.echo(json.dumps([entry for _, entry in entries], indent=1))
        return
    if not entries:
        click.echo("no calibration stored yet (a worker makes one when int8/uint8 is asked for)")
    for key, entry in entries:
        low, high = np.array(entry["min"]), np.array(entry["max"])
        click.echo(
            f"{key}\n  model {entry['model']}, variant {entry['variant']}, dim {entry['dim']}, "
            f"from {entry['texts']} texts ({entry['source']})\n"
            f"  min {low.min():+.4f}..{low.max():+.4f}, max {high.min():+.4f}..{high.max():+.4f}"
        )


async def _calibrations(settings: Settings) -> list[tuple[str, dict]]:
    async with client_for(settings) as producer:
        pattern = producer.keys.calibration("*", "*").replace("*:*", "*")
        keys = sorted([key.decode() async for key in producer.client.scan_iter(match=pattern)])
        values = await producer.client.mget(keys) if keys else []
    return [(key, json.loads(value)) for key, value in zip(keys, values, strict=True) if value]
