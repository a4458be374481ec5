"""A worker's resident memory is bounded however long its texts (issue 54, fault 4): one bulk
read takes at most EMBEDFLEET_READ_MAX_BYTES of payload, so 400 texts of ~20,000 tokens each,
embedded whole (``window_overlap``: every token held as ids, windows and batches), pass through
one worker within the bound docs/OPERATIONS.md gives, and every one comes out.

The worker runs the benchmark stand-in encoder (workers/model/standin.py: the real tokenizer,
reads, windows, batches, writes and acknowledgements; no forward pass): 32,000 windows through
the real model would take minutes on a CPU, and the model's own memory is bounded by the token
budget of a batch, not by the read."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from embedfleet.producer import Producer
from embedfleet.shared.protocol import Chunk
from embedfleet.shared.settings import Settings
from tests.conftest import WorkerLauncher

# the slow tier (make test-full, CI): starts a worker process
pytestmark = pytest.mark.slow

TEXTS = 400
LONG_WORDS = 20_000  # common English words: about one token each, ~120,000 characters a text
SHORT_WORDS = 200
MIB = 1024 * 1024
# docs/OPERATIONS.md, "Memory": what long texts may add to a worker's peak over short ones
READ_EXPANSION = 40  # times EMBEDFLEET_READ_MAX_BYTES: the reads held, decoded and windowed
READ_OVERHEAD_MIB = 32


def texts(prefix: str, count: int, words: int, overlap: int | None = None) -> list[Chunk]:
    """``count`` distinct texts of ``words`` words drawn from a small vocabulary."""
    vocabulary = [
        *[
            "the",
            "of",
            "and",
            "to",
            "in",
            "is",
            "was",
            "for",
            "on",
            "that",
            "with",
            "as",
            "by",
            "at",
            "from",
            "his",
            "her",
            "they",
            "this",
            "which",
        ],
        *[
            "have",
            "had",
            "were",
            "are",
            "been",
            "one",
            "all",
            "would",
            "there",
            "their",
            "will",
            "when",
            "who",
            "more",
            "time",
            "year",
        ],
        *[
            "people",
            "water",
            "house",
            "river",
            "city",
            "music",
            "paper",
            "light",
            "money",
            "story",
            "power",
            "world",
            "night",
        ],
    ]
    draw = random.Random(54)
    return [
        Chunk(
            id=f"{prefix}-{i}",
            text=f"{i} " + " ".join(draw.choices(vocabulary, k=words)),
            window_overlap=overlap,
        )
        for i in range(count)
    ]


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


async def test_long_texts_pass_one_worker_within_its_memory_bound(
    settings: Settings, workers: WorkerLauncher, client: aioredis.Redis
) -> None:
    """One worker process embeds 400 short texts, then 400 of ~20,000 tokens (~48 MB of text)
    whole, in windows: its peak resident memory rises by at most 40 x EMBEDFLEET_READ_MAX_BYTES
    + 32 MiB (192 MiB at a CPU's default, 4 MiB) over its peak on the short ones, and every
    long text's result comes out, once.

    Before (issue 54, fault 4): a read took all 400 long texts at once (1,024 entries a read on
    a CPU): +587 MiB (461 -> 1,048; 2.1 GB in the review). After: +126 (460 -> 586). With the
    real model and the texts cut at its maximum instead: +78 before, +0 after."""
    read_max_bytes = settings.batching("cpu").read_max_bytes  # the worker's: a CPU's default
    bound_mib = READ_EXPANSION * read_max_bytes / MIB + READ_OVERHEAD_MIB
    async with Producer(settings, client) as producer:
        await producer.enqueue(texts("short", TEXTS, SHORT_WORDS), job="short")
        worker = workers.process(
            "memory",
            settings,
            fresh=True,  # its peak RSS is the assertion: not a fork of tests/forks.py's imports
            EMBEDFLEET_REPLICAS="1",
            EMBEDFLEET_BENCHMARK_STANDIN_ENCODER_US_PER_TOKEN="0",
        )
        await producer.wait_for_job("short", timeout=600)
        short_peak = peak_rss_mib(worker.popen.pid)
        await producer.enqueue(texts("long", TEXTS, LONG_WORDS, overlap=32), job="long")
        progress = await producer.wait_for_job("long", timeout=600)
        long_peak = peak_rss_mib(worker.popen.pid)
    print(
        f"peak RSS of one worker: {short_peak:,.0f} MiB on short texts, {long_peak:,.0f} MiB "
        f"on {TEXTS} of {LONG_WORDS:,} words (+{long_peak - short_peak:,.0f}; bound "
        f"+{bound_mib:,.0f} at EMBEDFLEET_READ_MAX_BYTES={read_max_bytes:,})"
    )
    assert progress.done == TEXTS and progress.dead == 0, progress
    results = await client.xrange(settings.keys.results)
    assert len(results) == 2 * TEXTS, "every chunk's result, once (the long ones rejoined)"
    assert long_peak - short_peak <= bound_mib, (
        f"long texts took the worker from {short_peak:,.0f} to {long_peak:,.0f} MiB, over "
        f"{bound_mib:,.0f} MiB more (docs/OPERATIONS.md, memory)"
    )
