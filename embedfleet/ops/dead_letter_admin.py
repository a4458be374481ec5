"""Dead letters you can act on: `embedfleet dead list | show | replay | purge`.

``replay`` puts a dead letter's original payload (same chunk id, same job) back on the stream it
came from, once its cause is fixed. One Lua script per letter writes the new entry, moves the
job's count from ``dead`` back to pending and deletes the dead letter, atomically: the dead
entry disappears only with the new entry written, and two replays racing cannot both send it
(the second finds the letter gone). Were a chunk sent twice anyway, ids are idempotency keys:
every sink upserts by id. A replay sends only the letters there when it starts: one that fails
again comes back as a new letter, for the next replay.

Queries are not replayed (their caller has gone), nor letters that kept only a prefix of their
payload (over ``EMBEDFLEET_DEAD_PAYLOAD_MAX_BYTES``) or had none: they are listed as skipped.
"""

from __future__ import annotations

import functools
import json
import math
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import click
import redis.asyncio as aioredis

from embedfleet.ops.waiting import (
    StderrNotice,
    json_report_option,
    redis_url_option,
    run_client,
    verb_settings,
)
from embedfleet.shared import scripts
from embedfleet.shared.dead_letters import DeadLetter, DeadReason
from embedfleet.shared.keys import TENANT_STREAM_INFIX, Keys
from embedfleet.shared.protocol import ProtocolError, decode_chunk
from embedfleet.shared.redis_conn import connect_client_settings, redact_url, stream_entries
from embedfleet.shared.retry import RedisRetry
from embedfleet.shared.streams import text

PAGE = 500
T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

REPLAY_SCRIPT = scripts.load("replay_dead_letter")  # shared/scripts/replay_dead_letter.lua
REPLAY_MARKER_MIN_S = 3600


@dataclass(frozen=True)
class Filters:
    reason: DeadReason | None = None
    job: str | None = None

    def match(self, letter: DeadLetter) -> bool:
        return (self.reason is None or letter.reason is self.reason) and (
            self.job is None or letter.job == self.job
        )


@dataclass
class ReplayReport:
    replayed: list[DeadLetter]
    skipped: list[tuple[DeadLetter, str]]


class DeadLetterStore:
    """The dead-letter streams of one namespace (one per partition, and the priority streams'),
    read and acted on."""

    def __init__(self, client: aioredis.Redis, keys: Keys, retry: RedisRetry | None = None) -> None:
        """``retry`` rides out Redis restarts and dropped connections call by call (the CLI's,
        with its stderr notices); without it each call is tried once."""
        self.client = client
        self.keys = keys
        self.retry = retry
        # every key set that has a dead stream: each partition's, and the priority streams'
        self.sets: list[Keys] = list(keys.partitions_keys)
        if keys.partitioned:
            self.sets.append(keys.priority_streams)

    async def _call(self, doing: str, operation: Callable[[], Awaitable[T]]) -> T:
        """One Redis call, again after a transient fault: each call here is safe to repeat."""
        if self.retry is None:
            return await operation()
        return await self.retry.call(doing, operation)

    async def letters(self, filters: Filters = Filters()) -> AsyncIterator[DeadLetter]:
        """Every matching letter, oldest first within each dead stream."""
        async for _, letter in self._letters(filters):
            yield letter

    async def _letters(
        self, filters: Filters, upto: dict[str, str] | None = None
    ) -> AsyncIterator[tuple[Keys, DeadLetter]]:
        """``upto``: the last id to read of each dead stream (one missing: none of it); None
        reads each to its end, as it grows."""
        for owner in self.sets:
            last: str | None = "+" if upto is None else upto.get(owner.dead)
            if last is None:
                continue
            start = "-"
            while True:
                page = stream_entries(
                    await self._call(
                        "read the dead letters",
                        functools.partial(
                            self.client.xrange, owner.dead, min=start, max=last, count=PAGE
                        ),
                    )
                )
                for dead_id, fields in page:
                    letter = DeadLetter.from_fields(dead_id, fields)
                    if filters.match(letter):
                        yield owner, letter
                if len(page) < PAGE:
                    break
                start = "(" + letter.dead_id  # the page's last entry

    async def _newest_ids(self) -> dict[str, str]:
        """Each non-empty dead stream's newest id, now."""
        newest: dict[str, str] = {}
        for owner in self.sets:
            found = stream_entries(
                await self._call(
                    "read the dead letters",
                    functools.partial(self.client.xrevrange, owner.dead, count=1),
                )
            )
            if found:
                newest[owner.dead] = text(found[0][0])
        return newest

    async def get(self, dead_id: str) -> DeadLetter | None:
        for owner in self.sets:
            found = stream_entries(
                await self._call(
                    "read a dead letter",
                    functools.partial(self.client.xrange, owner.dead, min=dead_id, max=dead_id),
                )
            )
            if found:
                return DeadLetter.from_fields(*found[0])
        return None

    def why_not_replayable(self, letter: DeadLetter, owner: Keys | None = None) -> str | None:
        owner = owner or self.keys.partitions_keys[0]
        if letter.stream == self.keys.priority_streams.query:
            return "a query: its caller has gone"
        tenant_stream = letter.stream.startswith(owner.prefix + TENANT_STREAM_INFIX)
        if letter.stream != owner.ingest and not tenant_stream:
            return f"it came from {letter.stream!r}, not an ingest stream of this namespace"
        if letter.payload is None and letter.payload_prefix is not None:
            return (
                f"only a prefix was kept ({letter.payload_bytes} bytes, over "
                "EMBEDFLEET_DEAD_PAYLOAD_MAX_BYTES)"
            )
        if letter.payload is None:
            return "the entry had no payload to send again"
        return None

    def owner_of(self, letter: DeadLetter) -> Keys | None:
        try:
            return self.keys.owner_of(letter.stream)
        except KeyError:
            return None

    async def replay(self, filters: Filters, *, dry_run: bool = False) -> ReplayReport:
        report = ReplayReport([], [])
        token = uuid.uuid4().hex  # this command's replays, told apart from another's
        bound = 0 if self.retry is None else self.retry.give_up_after_s
        marker_s = max(REPLAY_MARKER_MIN_S, math.ceil(2 * bound))  # outlives any retry
        # Only the letters there now: a replay that fails again is dead-lettered again, at the
        # end of the stream being read, and reading to the end would replay it for ever.
        upto = await self._newest_ids()
        async for owner, letter in self._letters(filters, upto):
            problem = self.why_not_replayable(letter, owner)
            if problem is not None:
                report.skipped.append((letter, problem))
                continue
            if not dry_run:
                assert letter.payload is not None  # checked by why_not_replayable
                # the dead stream, the ingest stream it came from (the default tenant's or a
                # named tenant's) and the job's counters of one partition: one slot, one script
                keys = [owner.dead, letter.stream, owner.replayed(letter.dead_id)]
                if letter.job:
                    keys.append(owner.job(letter.job))
                args: list[str | bytes | int] = [letter.dead_id, letter.payload, token, marker_s]
                new_id = await self._call(
                    f"replay dead letter {letter.dead_id}",
                    # EVAL: one round trip, nothing to load again on a restarted server
                    functools.partial(self.client.eval, REPLAY_SCRIPT, len(keys), *keys, *args),
                )
                if new_id is None:  # replayed or purged meanwhile by someone else
                    report.skipped.append((letter, "already gone from the dead-letter stream"))
                    continue
            report.replayed.append(letter)
        return report

    async def purge(self, filters: Filters) -> int:
        by_stream: dict[str, list[str]] = {}
        async for owner, letter in self._letters(filters):
            by_stream.setdefault(owner.dead, []).append(letter.dead_id)
        deleted = 0
        for stream, ids in by_stream.items():
            for start in range(0, len(ids), PAGE):
                page = ids[start : start + PAGE]
                # XDEL again after a lost reply deletes nothing more; the count of the
                # repeat misses what the lost try deleted, never counts it twice
                deleted += await self._call(
                    "delete dead letters",
                    functools.partial(self.client.xdel, stream, *page),
                )
        return deleted


# --- CLI ------------------------------------------------------------------------------
def _with_store(redis_url: str | None, work: Callable[[DeadLetterStore], Awaitable[T]]) -> T:
    """Run ``work`` on the namespace's dead letters, riding out Redis restarts and dropped
    connections as every verb does (EMBEDFLEET_REDIS_RETRY_S): call by call, so that what was
    done before a fault is neither done again nor left out of the report."""
    settings = verb_settings(redis_url)

    async def main() -> T:
        client = connect_client_settings(settings)
        server = redact_url(settings.effective_redis_url)
        retry = RedisRetry(server, settings.redis_retry_s, StderrNotice(), settings.redis_connect_s)
        try:
            return await work(DeadLetterStore(client, settings.keys, retry))
        finally:
            await client.aclose()

    return run_client(main())


reason_option = click.option(
    "--reason",
    type=click.Choice([reason.value for reason in DeadReason]),
    help="Only letters with this reason code.",
)
job_option = click.option("--job", help="Only letters of this job.")


def letter_filters(command: F) -> F:
    """``--reason`` and ``--job``: which letters a verb acts on; ``--redis-url``."""
    return reason_option(job_option(redis_url_option(command)))


def _filters(reason: str | None, job: str | None) -> Filters:
    return Filters(DeadReason(reason) if reason else None, job)


def _line(letter: DeadLetter) -> str:
    detail = letter.detail if len(letter.detail) <= 100 else letter.detail[:97] + "..."
    return (
        f"{letter.dead_id}  {letter.reason.value:<12}  id={letter.chunk_id or '-'}  "
        f"job={letter.job or '-'}  {detail}"
    )


def _as_json(letter: DeadLetter) -> dict[str, object]:
    return {
        "dead_id": letter.dead_id,
        "reason": letter.reason.value,
        "detail": letter.detail,
        "stream": letter.stream,
        "entry_id": letter.entry_id,
        "id": letter.chunk_id,
        "job": letter.job,
        "deliveries": letter.deliveries,
        "payload_bytes": letter.payload_bytes,
        "replayable": letter.replayable,
    }


@click.group("dead")
def dead_group() -> None:
    """List, inspect, replay and purge dead letters ({namespace}:dead).

    Every dead letter has a reason code (the metrics' `reason` label) and a detail text.
    Fix the cause (a model setting, the database, the input), then `replay` puts the original
    chunks back on the ingest stream with their ids and jobs.
    """


@dead_group.command("list")
@letter_filters
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def list_command(reason: str | None, job: str | None, as_json: bool, redis_url: str | None) -> None:
    """Dead letters, oldest first: id in the dead stream, reason code, chunk id, job, detail."""

    async def work(store: DeadLetterStore) -> list[DeadLetter]:
        return [letter async for letter in store.letters(_filters(reason, job))]

    letters = _with_store(redis_url, work)
    for letter in letters:
        click.echo(json.dumps(_as_json(letter)) if as_json else _line(letter))
    if not as_json:
        counts = Counter(letter.reason.value for letter in letters)
        summary = ", ".join(f"{code} {n}" for code, n in sorted(counts.items())) or "none"
        click.echo(f"{len(letters)} dead letters ({summary})", err=True)


@dead_group.command("show")
@click.argument("dead_id")
@redis_url_option
def show_command(dead_id: str, redis_url: str | None) -> None:
    """Every field of one dead letter, with its payload decoded when it is a chunk."""

    async def work(store: DeadLetterStore) -> tuple[DeadLetter | None, str | None]:
        letter = await store.get(dead_id)
        if letter is None:
            return None, None
        return letter, store.why_not_replayable(letter, store.owner_of(letter))

    letter, problem = _with_store(redis_url, work)
    if letter is None:
        raise click.ClickException(f"no dead letter {dead_id!r} (see `embedfleet dead list`)")
    shown = _as_json(letter)
    shown["replayable"] = problem is None
    if problem is not None:
        shown["not_replayable_because"] = problem
    raw = letter.payload if letter.payload is not None else letter.payload_prefix
    if letter.payload is not None:
        try:
            chunk = decode_chunk(letter.payload)
            shown["chunk"] = {
                "id": chunk.id,
                "text": chunk.text,
                "job": chunk.job,
                "meta": chunk.meta,
            }
        except ProtocolError as error:
            shown["payload_problem"] = str(error)
    if raw is not None:
        shown["payload_hex" if letter.payload is not None else "payload_prefix_hex"] = raw[
            :512
        ].hex()
    click.echo(json.dumps(shown, indent=2, ensure_ascii=False, default=str))


@dead_group.command("replay")
@letter_filters
@click.option("--dry-run", is_flag=True, help="Only say what would be replayed.")
@json_report_option("the letters replayed and skipped")
def replay_command(
    reason: str | None, job: str | None, redis_url: str | None, dry_run: bool, as_json: bool
) -> None:
    """Send matching dead letters again: same payload, id and job, to the ingest stream.

    Each letter is deleted only together with its new entry being written (one Lua script),
    so nothing is lost, and replaying twice does not send a chunk twice.
    """

    async def work(store: DeadLetterStore) -> ReplayReport:
        return await store.replay(_filters(reason, job), dry_run=dry_run)

    report = _with_store(redis_url, work)
    if as_json:
        replayed = [{"dead_id": x.dead_id, "id": x.chunk_id, "job": x.job} for x in report.replayed]
        skipped = [
            {"dead_id": x.dead_id, "id": x.chunk_id, "why": why} for x, why in report.skipped
        ]
        click.echo(json.dumps({"dry_run": dry_run, "replayed": replayed, "skipped": skipped}))
        return
    verb = "would replay" if dry_run else "replayed"
    for letter in report.replayed:
        click.echo(f"{verb} {letter.dead_id}  id={letter.chunk_id or '-'}  job={letter.job or '-'}")
    for letter, why in report.skipped:
        click.echo(f"skipped {letter.dead_id}  id={letter.chunk_id or '-'}: {why}", err=True)
    click.echo(f"{verb} {len(report.replayed)}, skipped {len(report.skipped)}")


@dead_group.command("purge")
@letter_filters
@json_report_option("how many letters were deleted")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def purge_command(
    reason: str | None, job: str | None, redis_url: str | None, as_json: bool, yes: bool
) -> None:
    """Delete matching dead letters for good (all of them without filters)."""
    if not yes:
        scope = " and ".join(
            part for part in (reason and f"reason {reason}", job and f"job {job}") if part
        )
        click.confirm(f"delete every dead letter{' with ' + scope if scope else ''}?", abort=True)

    async def work(store: DeadLetterStore) -> int:
        return await store.purge(_filters(reason, job))

    purged = _with_store(redis_url, work)
    click.echo(json.dumps({"purged": purged}) if as_json else f"purged {purged} dead letters")
