"""Move a live vector table to another model with no downtime (``embedfleet migrate``).

The steps, each a function here and a verb of ``embedfleet migrate`` (ops/migrate_cli.py):

1. ``start``: write the migration record (``Keys.migration(source)``, shared/migrations.py)
   with ``dual_write`` set, so from now on every database sink writing the source table also
   enqueues what it wrote to model B's lane; register which lane writes which table
   (``Keys.table_lanes``) and the target's source (``Keys.migration_targets``); point the reader
   name (the alias) at the source table if it does not exist yet.
2. ``copy``: scan the source's stored texts page by page and enqueue them to model B's lane
   (its workers write the target table), recording the scan's cursor after each page, so a
   copy killed at any point resumes where it was (a page sent twice is added once: the chunks
   keep their job, whose id record skips a re-sent payload; chunks without a job are embedded
   twice at worst and upserted by id). Then, once lane B is idle, verify: every id of the
   source must be in the target with the same text; what is missing or different is sent
   again, until nothing is. Once verified, the dual write goes both ways (``dual_write_back``):
   what lane B's sinks write to the target is copied to lane A too, so producers may move to
   lane B and a rollback still finds everything in the source.
3. ``canary``: search both tables for a query set, each with its own model: neighbour overlap
   at k, or recall at k on a labelled set.
4. ``switch`` / ``rollback``: point the alias at the target / the source in one atomic step
   (a Qdrant alias, a PostgreSQL view, a LanceDB pointer file). A switch also turns the copy
   back to lane A on (a forced switch before the copy was verified), so whichever lane the
   producers write, both tables get it until ``finish``.
5. ``finish``: stop the dual write both ways; ``--drop-old`` also drops the table readers no
   longer use.

``embedfleet search`` resolves the alias to its table and embeds the query with that table's
model (``Keys.table_lanes``), so a query gets A's answers or B's, never a mix.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from embedfleet.producer.client import EmbeddingOptions, Producer
from embedfleet.shared import migrations as m
from embedfleet.shared.keys import Keys
from embedfleet.shared.modelcard import ModelCard, read_card
from embedfleet.shared.protocol import Chunk
from embedfleet.shared.settings import Settings
from embedfleet.sinks import (
    Hit,
    SinkTarget,
    StoredRow,
    VectorBackend,
    VectorDBError,
    open_backend,
)

DEFAULT_PAGE = 1000
# characters per token when no tokenizer of model B is at hand (English prose, WordPiece/BPE)
CHARS_PER_TOKEN = 4.0
VERIFY_ROUNDS = 5
IDLE_POLL_S = 0.2


class MigrationError(RuntimeError):
    """A migration step that cannot be done as asked; the message says what to do."""


@dataclass
class Migration:
    """One migration: the sink (lane A's settings), its record's fields."""

    settings: Settings
    sink: SinkTarget
    record: dict[str, str]

    @property
    def source(self) -> str:
        return self.record[m.SOURCE]

    @property
    def target(self) -> str:
        return self.record[m.TARGET]

    @property
    def alias(self) -> str:
        return self.record[m.ALIAS]

    @property
    def source_lane(self) -> str | None:
        return self.record.get(m.SOURCE_LANE) or None

    @property
    def target_lane(self) -> str | None:
        return self.record.get(m.TARGET_LANE) or None

    def backend(self, table: str) -> VectorBackend:
        return open_backend(dataclasses.replace(self.sink, table=table))

    def lane_settings(self, lane: str | None) -> Settings:
        return self.settings.model_copy(update={"model_lane": lane})

    @property
    def copies(self) -> list[Copy]:
        """The dual writes the record turns on now: which table's sinks copy to which lane."""
        if self.record.get(m.DUAL_WRITE) != "1":
            return []
        ahead = Copy(self.source, m.lane_name(self.target_lane), self.target)
        if self.record.get(m.DUAL_WRITE_BACK) != "1":
            return [ahead]
        return [ahead, Copy(self.target, m.lane_name(self.source_lane), self.source)]

    def describe_copies(self) -> str:
        """Which tables are written, as the workers' sinks do it now (from the record)."""
        copies = self.copies
        if not copies:
            return (
                f"no table is copied (the dual write is off): lane {_lane(self.source_lane)} "
                f"writes only {self.source!r}, lane {_lane(self.target_lane)} only {self.target!r}"
            )
        writer = {self.source: self.source_lane, self.target: self.target_lane}
        said = [
            f"what is written to {c.from_table!r} (lane {_lane(writer[c.from_table])}) is "
            f"copied to lane {_lane(c.to_lane or None)} ({c.to_table!r})"
            for c in copies
        ]
        if len(copies) == 1:
            said.append(
                f"{self.target!r} (lane {_lane(self.target_lane)}) is not copied back to "
                f"{self.source!r} until the copy is verified or the readers switched: keep "
                f"producers on lane {_lane(self.source_lane)} until then"
            )
        return "; ".join(said) + " (until `embedfleet migrate finish`)"

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "source_lane": self.source_lane,
            "target": self.target,
            "target_lane": self.target_lane,
            "alias": self.alias,
            "state": self.record.get(m.STATE),
            "readers": self.record.get(m.READERS),
            "dual_write": self.record.get(m.DUAL_WRITE) == "1",
            "dual_write_back": bool(self.copies[1:]),
            "copies": [dataclasses.asdict(copy) for copy in self.copies],
        }


@dataclass(frozen=True)
class Copy:
    """One direction of the dual write: the sinks of ``from_table`` copy what they write to
    lane ``to_lane`` ('' the default lane), whose workers write ``to_table``."""

    from_table: str
    to_lane: str
    to_table: str


def _lane(lane: str | None) -> str:
    return lane or "default"


async def load(
    settings: Settings, client: aioredis.Redis, sink: SinkTarget, source: str
) -> Migration:
    """The migration of ``source``; MigrationError when there is none."""
    record = m.decoded(await client.hgetall(settings.keys.migration(source)))
    if not record:
        raise MigrationError(
            f"no migration of table {source!r}: start one with `embedfleet migrate start "
            "--to-lane LANE --to-table TABLE`"
        )
    return Migration(settings, sink, record)


async def start(
    settings: Settings,
    client: aioredis.Redis,
    sink: SinkTarget,
    *,
    source: str,
    target: str | None,
    target_lane: str | None,
    alias: str | None,
) -> Migration:
    """Create the migration record (dual write on) or take up the one there is: the same
    target and lane (or none given) resume it; another target is refused."""
    key = settings.keys.migration(source)
    record = m.decoded(await client.hgetall(key))
    if record and record.get(m.STATE) != "finished":
        _check_resumed(
            record, source, {m.TARGET: target, m.TARGET_LANE: target_lane, m.ALIAS: alias}
        )
        return Migration(settings, sink, record)
    target, target_lane = _check_new(settings, source, target, target_lane)
    _check_text_lane(await read_card(client, settings.keys), source)
    alias = alias or f"{source}_live"
    record = {
        m.SOURCE: source,
        m.SOURCE_LANE: m.lane_name(settings.model_lane),
        m.TARGET: target,
        m.TARGET_LANE: m.lane_name(target_lane),
        m.ALIAS: alias,
        m.READERS: "source",
        m.STATE: "copying",
        m.CURSOR: "",
        m.SCANNED: "0",
        m.STARTED_MS: str(int(time.time() * 1000)),
    }
    migration = Migration(settings, sink, record)
    with migration.backend(source) as backend:
        await asyncio.to_thread(_check_source, backend)
    await _take_alias(migration)
    await _save_started(client, migration)
    return migration


def _check_resumed(record: dict[str, str], source: str, given: dict[str, str | None]) -> None:
    """A migration under way is resumed with no options or the ones it was started with."""
    for name, value in given.items():
        if value is not None and m.lane_name(value) != record.get(name, ""):
            raise MigrationError(
                f"table {source!r} is already being migrated to {record[m.TARGET]!r} "
                f"(lane {record.get(m.TARGET_LANE) or 'default'}, alias {record[m.ALIAS]!r}): "
                "run `embedfleet migrate start` without options to resume it, or end it "
                "with `embedfleet migrate finish`"
            )


def _check_new(
    settings: Settings, source: str, target: str | None, target_lane: str | None
) -> tuple[str, str]:
    """A new migration's target table and lane: both given, neither the source's own."""
    if target is None or target_lane is None:
        raise MigrationError("a new migration needs --to-table and --to-lane")
    if target == source:
        raise MigrationError("--to-table must name a new table, not the one being migrated")
    if m.lane_name(target_lane) == m.lane_name(settings.model_lane):
        raise MigrationError(
            f"--to-lane {target_lane!r} is the lane that writes {source!r} now: migrate to "
            "another model's lane (its workers run with EMBEDFLEET_MODEL_LANE)"
        )
    return target, target_lane


async def _take_alias(migration: Migration) -> None:
    """The alias readers use: made on the source where there is none yet; one pointing at the
    source or the target (an earlier run's) is kept and says where readers are."""
    source, target, alias = migration.source, migration.target, migration.alias
    with migration.backend(alias) as reader:
        points_at = await asyncio.to_thread(reader.resolve)
    if points_at == alias:  # no alias yet: readers can move to it now, it reads the source
        with migration.backend(source) as backend:
            await asyncio.to_thread(backend.point_alias, alias)
    elif points_at not in (source, target):
        raise MigrationError(f"the alias {alias!r} points at {points_at!r}: choose another --alias")
    else:
        migration.record[m.READERS] = "source" if points_at == source else "target"


async def _save_started(client: aioredis.Redis, migration: Migration) -> None:
    """The new record written with the dual write on, the tables' lanes and the target's way
    back to its source, in one transaction."""
    settings, record = migration.settings, migration.record
    source, target = migration.source, migration.target
    key = settings.keys.migration(source)
    pipe = client.pipeline(transaction=True)
    pipe.delete(key)
    # the dual write is on before the first page is read (shared/migrations.py says why)
    pipe.hset(key, mapping=m.as_mapping({**record, m.DUAL_WRITE: "1"}))
    pipe.hset(
        settings.keys.table_lanes,
        mapping={source: record[m.SOURCE_LANE], target: record[m.TARGET_LANE]},
    )
    # the target's sinks find the record here once the copy goes both ways
    pipe.hset(settings.keys.migration_targets, target, source)
    await pipe.execute()
    migration.record[m.DUAL_WRITE] = "1"


def _check_text_lane(card: ModelCard | None, source: str) -> None:
    """A table written by a lane that embeds images (CLIP, SigLIP) is refused: its image rows
    keep their reference in the text column, not the image (issue 56), and a migration would
    embed those references as texts."""
    if card is not None and "image" in card.modalities:
        raise MigrationError(
            f"table {source!r} is written by {card.name!r}, which embeds images: its image rows "
            "hold where each image came from, not the image, and a migration re-embeds stored "
            "texts. Enqueue the images again to the new model's table instead "
            "(docs/INGESTION.md, 'Embed a folder of images')"
        )


def _check_source(backend: VectorBackend) -> None:
    rows, _ = backend.scan_rows(None, 1)
    if rows and rows[0].text is None:
        raise MigrationError(
            f"{backend.target.describe()} holds no texts (EMBEDFLEET_STORE_TEXT was off when it "
            "was written): a migration re-embeds the stored texts"
        )


# --- the copy -------------------------------------------------------------------------------
@dataclass
class CopyReport:
    """What ``copy`` did and measured."""

    total: int = 0  # rows in the source
    in_target: int = 0  # rows in the target at the end
    enqueued: int = 0  # rows of the source enqueued by this run
    resent: int = 0  # rows the verification sent again (missing or different in the target)
    missing: int = 0  # still missing or different after the rounds (0: verified)
    seconds: float = 0.0
    rows_per_s: float = 0.0
    tokens_per_row: float = 0.0
    tokens_measured: str = "characters"
    verified: bool = False

    @property
    def tokens(self) -> int:
        return round(self.tokens_per_row * self.total)

    def as_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "tokens": self.tokens,
            "tokens_per_s": round(self.rows_per_s * self.tokens_per_row, 1),
        }


@dataclass
class Estimate:
    """Progress and what is left, from the rates measured so far."""

    done: int
    total: int
    rows_per_s: float
    tokens_per_row: float
    tokens_measured: str

    @property
    def seconds_left(self) -> float | None:
        left = max(0, self.total - self.done)
        if left == 0:
            return 0.0
        return None if self.rows_per_s <= 0 else left / self.rows_per_s

    @property
    def tokens_total(self) -> int:
        return round(self.tokens_per_row * self.total)

    def describe(self) -> str:
        left = self.seconds_left
        eta = "unknown" if left is None else f"{left:,.0f} s"
        return (
            f"{self.done:,} of {self.total:,} rows in the target, {self.rows_per_s:,.1f} rows/s, "
            f"{self.rows_per_s * self.tokens_per_row:,.0f} tokens/s; about {eta} left; "
            f"about {self.tokens_total:,} tokens in all ({self.tokens_measured})"
        )

    def as_dict(self) -> dict[str, Any]:
        left = self.seconds_left
        return {
            "done": self.done,
            "total": self.total,
            "rows_per_s": round(self.rows_per_s, 2),
            "tokens_per_s": round(self.rows_per_s * self.tokens_per_row, 1),
            "seconds_left": None if left is None else round(left, 1),
            "tokens_total": self.tokens_total,
            "tokens_measured": self.tokens_measured,
        }


class TokenMeter:
    """Tokens per row of the texts seen: model B's tokenizer when given, else characters / 4."""

    def __init__(self, model_dir: Path | None, max_length: int) -> None:
        self.rows = 0
        self.tokens = 0
        self.max_length = max_length
        self.tokenizer: Any = None
        if model_dir is not None:
            from embedfleet.producer.tokens import ModelTokenizer

            self.tokenizer = ModelTokenizer(model_dir)

    @property
    def measured(self) -> str:
        return "tokenizer" if self.tokenizer is not None else "characters"

    def count(self, texts: Sequence[str]) -> None:
        if self.tokenizer is not None:
            self.tokens += self.tokenizer.usage(texts, self.max_length)
        else:
            self.tokens += round(sum(len(text) for text in texts) / CHARS_PER_TOKEN)
        self.rows += len(texts)

    @property
    def per_row(self) -> float:
        return self.tokens / self.rows if self.rows else 0.0


async def copy(
    migration: Migration,
    client: aioredis.Redis,
    *,
    page: int = DEFAULT_PAGE,
    model_dir: Path | None = None,
    on_progress: Callable[[Estimate], None] | None = None,
    idle_timeout_s: float | None = None,
) -> CopyReport:
    """Enqueue the source's rows to lane B from the recorded cursor, then verify the target
    holds every id with its text, sending again what it does not (``VERIFY_ROUNDS`` rounds).
    ``idle_timeout_s``: how long to wait for lane B to go idle before a round (None: as long
    as it takes)."""
    settings = migration.settings
    key = settings.keys.migration(migration.source)
    lane = migration.lane_settings(migration.target_lane)
    started = time.monotonic()
    async with Producer(lane, client) as producer:
        card = await producer.model_card()
        meter = TokenMeter(model_dir, card.max_length if card is not None else 512)
        with migration.backend(migration.source) as source:
            total = await asyncio.to_thread(source.count_rows)
            await client.hset(key, m.TOTAL, str(total))
            report = CopyReport(total=total)
            monitor = _Monitor(migration, client, total, meter, on_progress)
            await monitor.tick(force=True)
            if migration.record.get(m.SCAN_DONE) != "1":
                report.enqueued = await _scan(
                    migration, client, source, producer, page, meter, monitor
                )
            await _verify(migration, client, producer, monitor, report, idle_timeout_s)
            await monitor.tick(force=True)
    report.in_target = monitor.done
    report.seconds = time.monotonic() - started
    report.rows_per_s = monitor.rate
    await _save_copied(migration, client, report, meter)
    return report


async def _verify(
    migration: Migration,
    client: aioredis.Redis,
    producer: Producer,
    monitor: _Monitor,
    report: CopyReport,
    idle_timeout_s: float | None,
) -> None:
    """Once lane B is idle, send again what the target lacks, up to ``VERIFY_ROUNDS`` rounds:
    ``report.verified`` when it lacks nothing, else how many are still missing."""
    key = migration.settings.keys.migration(migration.source)
    lane = migration.lane_settings(migration.target_lane)
    for _ in range(VERIFY_ROUNDS):
        await _until_idle(client, lane.keys, monitor, idle_timeout_s)
        differ = await asyncio.to_thread(_differences, migration)
        if not differ:
            report.verified = True
            return
        # force: a chunk whose first copy was lost (dead-lettered, a table wiped) has
        # the same payload, which its job's id record would skip
        await producer.enqueue(differ, force=True)
        report.resent += len(differ)
        await client.hincrby(key, m.RESENT, len(differ))
    report.missing = len(await asyncio.to_thread(_differences, migration))


async def _save_copied(
    migration: Migration, client: aioredis.Redis, report: CopyReport, meter: TokenMeter
) -> None:
    """The copy's figures in the report and the record; a verified copy's state "copied"."""
    key = migration.settings.keys.migration(migration.source)
    # this run's texts, or (a resumed run that had nothing left to scan) the last run's figure
    if meter.rows:
        report.tokens_per_row, report.tokens_measured = meter.per_row, meter.measured
    else:
        report.tokens_per_row = float(migration.record.get(m.TOKENS_PER_ROW) or 0.0)
        report.tokens_measured = migration.record.get(m.TOKENS_MEASURED) or meter.measured
    fields: dict[str, str] = {
        m.ROWS_PER_S: f"{report.rows_per_s:.3f}",
        m.TOKENS_PER_ROW: f"{report.tokens_per_row:.3f}",
        m.TOKENS_MEASURED: report.tokens_measured,
    }
    if report.verified:
        # the target holds what the source holds: from now on each table's sinks copy what
        # they write to the other lane, so producers may move to lane B (shared/migrations.py)
        fields |= {
            m.STATE: "copied",
            m.COPIED_MS: str(int(time.time() * 1000)),
            m.DUAL_WRITE_BACK: "1",
        }
    await client.hset(key, mapping=m.as_mapping(fields))
    migration.record.update(fields)


async def _scan(
    migration: Migration,
    client: aioredis.Redis,
    source: VectorBackend,
    producer: Producer,
    page: int,
    meter: TokenMeter,
    monitor: _Monitor,
) -> int:
    key = migration.settings.keys.migration(migration.source)
    cursor = migration.record.get(m.CURSOR) or None
    scanned = int(migration.record.get(m.SCANNED) or 0)
    enqueued = 0
    while True:
        rows, after = await asyncio.to_thread(source.scan_rows, cursor, page)
        chunks = [_chunk(row) for row in rows if row.text is not None]
        if chunks:
            meter.count([chunk.text for chunk in chunks])
            await producer.enqueue(chunks)  # waits while lane B's backlog is over the mark
        scanned += len(rows)
        enqueued += len(rows)
        # the cursor only moves once the page is in lane B's stream: a copy killed before
        # this line sends the page again, which its jobs' id records add once
        fields = {m.CURSOR: after or "", m.SCANNED: str(scanned)}
        if after is None:
            fields[m.SCAN_DONE] = "1"
        if meter.per_row:
            fields |= {m.TOKENS_PER_ROW: f"{meter.per_row:.3f}", m.TOKENS_MEASURED: meter.measured}
        await client.hset(key, mapping=m.as_mapping(fields))
        migration.record.update(fields)
        await monitor.tick()
        if after is None:
            return enqueued
        cursor = after


def _chunk(row: StoredRow) -> Chunk:
    assert row.text is not None
    return Chunk(id=row.id, text=row.text, job=row.job, meta=row.meta)


class _Monitor:
    """Counts the target's rows at most twice a second and reports the estimate."""

    INTERVAL_S = 0.5

    def __init__(
        self,
        migration: Migration,
        client: aioredis.Redis,
        total: int,
        meter: TokenMeter,
        on_progress: Callable[[Estimate], None] | None,
    ) -> None:
        self.migration = migration
        self.client = client
        self.total = total
        self.meter = meter
        self.on_progress = on_progress
        self.done = 0
        self._first: tuple[float, int] | None = None
        self._last = float("-inf")
        self.rate = 0.0

    async def tick(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.INTERVAL_S:
            return
        self._last = now
        self.done = await asyncio.to_thread(_count_or_zero, self.migration, self.migration.target)
        if self._first is None:
            self._first = (now, self.done)
        elif now > self._first[0]:
            self.rate = (self.done - self._first[1]) / (now - self._first[0])
            # for `embedfleet migrate status` in another shell: the rate as measured now
            await self.client.hset(
                self.migration.settings.keys.migration(self.migration.source),
                m.ROWS_PER_S,
                f"{self.rate:.3f}",
            )
        if self.on_progress is not None:
            per_row = self.meter.per_row or float(
                self.migration.record.get(m.TOKENS_PER_ROW) or 0.0
            )
            self.on_progress(
                Estimate(self.done, self.total, self.rate, per_row, self.meter.measured)
            )


def _count_or_zero(migration: Migration, table: str) -> int:
    """Rows in ``table``; 0 while lane B's workers have not created it yet."""
    try:
        with migration.backend(table) as backend:
            return backend.count_rows()
    except VectorDBError:
        return 0


async def _until_idle(
    client: aioredis.Redis, lane: Keys, monitor: _Monitor, timeout_s: float | None
) -> None:
    """Until every ingest stream of the lane is empty with nothing pending in its group."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not await _idle(client, lane):
        if deadline is not None and time.monotonic() > deadline:
            raise MigrationError(
                f"lane {lane.model_lane or 'default'} still has work queued after {timeout_s:g}s: "
                "are its workers running (EMBEDFLEET_MODEL_LANE) and writing the target table?"
            )
        await monitor.tick()
        await asyncio.sleep(IDLE_POLL_S)


async def queued(client: aioredis.Redis, lane: Keys) -> int:
    """Entries in the lane's ingest streams: read and not acknowledged yet, or not read (an
    acknowledged entry is deleted). After a switch or a rollback, the copies of what the other
    lane wrote that are not in the table yet are among them."""
    pipe = client.pipeline(transaction=False)
    for partition in lane.partitions_keys:
        pipe.xlen(partition.ingest)
    return sum(int(length) for length in await pipe.execute())


async def _idle(client: aioredis.Redis, lane: Keys) -> bool:
    pipe = client.pipeline(transaction=False)
    for partition in lane.partitions_keys:
        pipe.xlen(partition.ingest)
        pipe.xpending(partition.ingest, partition.group)
    answers = await pipe.execute()
    lengths, pending = answers[0::2], answers[1::2]
    return not any(lengths) and not any(int(p["pending"]) for p in pending)


def _digests(backend: VectorBackend, page: int = 5000) -> dict[str, tuple[bytes, StoredRow]]:
    """Every row of a table by id, with a digest of its text."""
    found: dict[str, tuple[bytes, StoredRow]] = {}
    cursor: str | None = None
    while True:
        rows, cursor = backend.scan_rows(cursor, page)
        for row in rows:
            text = (row.text or "").encode()
            found[row.id] = (hashlib.blake2b(text, digest_size=8).digest(), row)
        if cursor is None:
            return found


def _differences(migration: Migration) -> list[Chunk]:
    """The source's rows the target lacks or holds with another text."""
    with migration.backend(migration.source) as source:
        wanted = _digests(source)
    try:
        with migration.backend(migration.target) as target:
            held = _digests(target)
    except VectorDBError:
        held = {}
    return [
        _chunk(row)
        for row_id, (digest, row) in sorted(wanted.items())
        if row.text is not None and held.get(row_id, (None,))[0] != digest
    ]


async def estimate(migration: Migration) -> Estimate:
    """Progress and the time left, from the rates the last copy run measured."""
    done = await asyncio.to_thread(_count_or_zero, migration, migration.target)
    total = int(migration.record.get(m.TOTAL) or 0) or await asyncio.to_thread(
        _count_or_zero, migration, migration.source
    )
    return Estimate(
        done,
        total,
        float(migration.record.get(m.ROWS_PER_S) or 0.0),
        float(migration.record.get(m.TOKENS_PER_ROW) or 0.0),
        migration.record.get(m.TOKENS_MEASURED) or "characters",
    )


# --- the switch -------------------------------------------------------------------------------
async def point_readers(
    migration: Migration, client: aioredis.Redis, to: str, *, force: bool = False
) -> str:
    """Point the alias at the ``to`` table ('source' or 'target') in one atomic step."""
    if migration.record.get(m.STATE) == "finished" and not force:
        raise MigrationError("this migration is finished; its other table is no longer written")
    if to == "target" and migration.record.get(m.STATE) != "copied" and not force:
        raise MigrationError(
            f"the copy into {migration.target!r} is not verified complete (state "
            f"{migration.record.get(m.STATE)}): finish it with `embedfleet migrate start`, or "
            "switch anyway with --force"
        )
    table = migration.target if to == "target" else migration.source
    key = migration.settings.keys.migration(migration.source)
    if to == "target" and migration.record.get(m.DUAL_WRITE) == "1":
        # before the readers move (a forced switch comes before the verified copy turned it
        # on): what producers moved to lane B write must reach the source too, for a rollback
        await client.hset(key, m.DUAL_WRITE_BACK, "1")
        migration.record[m.DUAL_WRITE_BACK] = "1"
    with migration.backend(table) as backend:
        await asyncio.to_thread(backend.point_alias, migration.alias)
    await client.hset(key, m.READERS, to)
    migration.record[m.READERS] = to
    return table


async def finish(migration: Migration, client: aioredis.Redis, *, drop_old: bool) -> str | None:
    """Stop the dual write; with ``drop_old``, drop the table the alias does not point at.
    Returns the dropped table's name."""
    keys = migration.settings.keys
    with migration.backend(migration.alias) as reader:
        reading = await asyncio.to_thread(reader.resolve)
    other = migration.source if reading == migration.target else migration.target
    pipe = client.pipeline(transaction=True)
    pipe.hdel(keys.migration(migration.source), m.DUAL_WRITE, m.DUAL_WRITE_BACK)
    pipe.hset(keys.migration(migration.source), m.STATE, "finished")
    await pipe.execute()
    await client.hdel(keys.migration_targets, migration.target)  # another slot on a cluster
    migration.record[m.STATE] = "finished"
    migration.record.pop(m.DUAL_WRITE, None)
    migration.record.pop(m.DUAL_WRITE_BACK, None)
    if not drop_old:
        return None
    with migration.backend(other) as backend:
        await asyncio.to_thread(backend.drop_table)
    await client.hdel(keys.table_lanes, other)
    return other


# --- reading through the alias ---------------------------------------------------------------
async def lane_of(
    client: aioredis.Redis, keys: Keys, table: str, default: str | None
) -> str | None:
    """The model lane that writes ``table`` (``Keys.table_lanes``), else ``default``."""
    lane = await client.hget(keys.table_lanes, table)
    if lane is None:
        return default
    return m.text(lane) or None


# --- the canary ------------------------------------------------------------------------------
@dataclass
class Query:
    text: str
    relevant: frozenset[str] | None = None


@dataclass
class CanaryReport:
    k: int
    queries: int
    overlap: float  # mean |top-k of A ∩ top-k of B| / k
    recall_source: float | None = None  # mean recall@k on the labelled set, per table
    recall_target: float | None = None
    per_query: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def read_queries(path: Path) -> list[Query]:
    """One query per line: plain text, or JSON {"query": ..., "relevant": [ids]} (labelled)."""
    queries = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                item = json.loads(line)
                relevant = item.get("relevant")
                queries.append(
                    Query(str(item["query"]), None if relevant is None else frozenset(relevant))
                )
            except (ValueError, KeyError, TypeError) as error:
                raise MigrationError(f"{path}:{number}: not a query line ({error})") from None
        else:
            queries.append(Query(line.strip()))
    if not queries:
        raise MigrationError(f"{path} holds no queries")
    return queries


async def _nearest_all(
    migration: Migration,
    client: aioredis.Redis,
    table: str,
    lane: str | None,
    texts: Sequence[str],
    k: int,
    timeout: float,
) -> list[list[Hit]]:
    with migration.backend(table) as backend:
        _, dim = await asyncio.to_thread(backend.vector_format)
        options = EmbeddingOptions(dimensions=dim, dtype="float32")
        async with Producer(migration.lane_settings(lane), client) as producer:
            vectors: list[np.ndarray] = []
            for start in range(0, len(texts), 16):  # the query stream takes small requests
                batch = texts[start : start + 16]
                vectors.extend(
                    await producer.embed_queries(batch, timeout=timeout, options=options)
                )
        return [await asyncio.to_thread(backend.nearest, np.asarray(v), k) for v in vectors]


async def canary(
    migration: Migration,
    client: aioredis.Redis,
    queries: Iterable[Query],
    *,
    k: int = 10,
    timeout: float = 30.0,
) -> CanaryReport:
    """Search both tables for every query, each with its own model."""
    asked = list(queries)
    texts = [q.text for q in asked]
    source = await _nearest_all(
        migration, client, migration.source, migration.source_lane, texts, k, timeout
    )
    target = await _nearest_all(
        migration, client, migration.target, migration.target_lane, texts, k, timeout
    )
    per_query: list[dict[str, Any]] = []
    recalls: tuple[list[float], list[float]] = ([], [])
    for query, a, b in zip(asked, source, target, strict=True):
        ids_a, ids_b = [h.id for h in a], [h.id for h in b]
        entry: dict[str, Any] = {
            "query": query.text,
            "overlap": len(set(ids_a) & set(ids_b)) / k,
            "source": ids_a,
            "target": ids_b,
        }
        if query.relevant:
            for found, ids, name in ((recalls[0], ids_a, "source"), (recalls[1], ids_b, "target")):
                value = len(query.relevant & set(ids)) / len(query.relevant)
                found.append(value)
                entry[f"recall_{name}"] = value
        per_query.append(entry)
    return CanaryReport(
        k=k,
        queries=len(asked),
        overlap=float(np.mean([e["overlap"] for e in per_query])),
        recall_source=float(np.mean(recalls[0])) if recalls[0] else None,
        recall_target=float(np.mean(recalls[1])) if recalls[1] else None,
        per_query=per_query,
    )
