"""Reliability settings: redelivery, retries, the backlog's bound, and how long records live."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from embedfleet.shared.settings.section import Section


class ReliabilitySettings(Section):
    """What happens to work that is stuck, refused or waiting: claims, dead letters, sink
    retries, the backlog and results bounds, and the life of job and reply records."""

    title: ClassVar[str] = "Reliability: redelivery, retries, bounds and retention"

    reclaim_idle_ms: int = Field(default=60_000, ge=100)
    """Entries pending this long on another consumer are claimed (XAUTOCLAIM). Keep it above the
    worst batch time; live workers renew their own entries."""
    max_deliveries: int = Field(default=5, ge=1)
    """An entry delivered this many times is dead-lettered."""
    sink_retries: int = Field(default=5, ge=1)
    """Tries of a sink write failing with an error not known to be passing (not an outage, not one
    refused row) before the worker exits non-zero. Outages are waited out however long they last; a
    refused row is dead-lettered alone."""
    job_ids_ttl_s: int = Field(default=7 * 24 * 3600, ge=0)
    """How long a job remembers the chunk ids it has enqueued (`{ns}:jobids:<job>`), counted from
    its latest enqueue: within it a re-sent chunk (same id, same payload) is added and counted once.
    0 = for ever. Costs about the id's length + 60 bytes per chunk."""
    job_ids_finished_ttl_s: int = Field(default=3600, ge=0)
    """Once a job has finished (every chunk embedded or dead-lettered), its id record expires
    this long after its last acknowledgement instead, so a finished job's record costs nothing
    for long; an enqueue to the job later gives it `EMBEDFLEET_JOB_IDS_TTL_S` again. A re-sent
    chunk after it has expired is embedded and counted again (the job still finishes). 0 = the
    record lives `EMBEDFLEET_JOB_IDS_TTL_S` however the job ends."""
    backlog_high_water: int = Field(default=1_000_000, ge=1)
    """Producers wait while an ingest stream (each partition's) holds more entries than this; the
    gateway answers 429 to large requests while the interactive stream does."""
    results_max_entries: int = Field(default=1_000_000, ge=0)
    """Most results a results stream (each partition's) may hold: at it, workers wait, saying so
    in their log, until a consuming reader (`embedfleet results --consume`,
    `Producer.results(consume=True)`) drains it below. The bound applies whether or not a reader
    runs, as the backlog's does. 0 = no bound (results kept until trimmed by hand)."""
    results_claim_idle_ms: int = Field(default=60_000, ge=100)
    """A consuming results reader claims results another reader has held unacknowledged this long
    (a reader that crashed mid-page). Keep it above the time a reader takes over one page."""
    job_reply_ttl_s: int = Field(default=7 * 24 * 3600, ge=60)
    """Reply lists of ingest chunks sent with a `reply` (the gateway's large requests and batches)
    expire this long after their last result if nobody collects them."""
