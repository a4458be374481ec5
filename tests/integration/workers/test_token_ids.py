"""Token ids from the producer (issue 53: tokenize where the CPUs are), through a real worker
with the packaged model and a real redis-server.

- The vectors of chunks sent with the producer's ids are bit-identical (float32 output) to the
  vectors of the same chunks sent as text: the same texts, one run each, with no slice limit
  (batches planned by the token budget alone), so the worker computes the same batches; texts
  over the model's maximum and a literal prompt included.
- The worker takes the ids: its tokenizer is not called for them.
- Ids made by another tokenizer are dead-lettered with reason ``tokenizer`` (sent as any
  language would, msgpack on the stream), and the producer refuses such a chunk before sending,
  with the same reason.
- ``embedfleet enqueue --token-ids`` sends ids too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator, Sequence
from typing import Any

import msgpack
import numpy as np
import pytest
import redis.asyncio as aioredis

from embedfleet.producer.client import EmbeddingOptions, Producer
from embedfleet.shared.protocol import PAYLOAD_FIELD, decode_chunk
from embedfleet.shared.settings import Settings
from embedfleet.shared.tokens import pack_token_ids, unpack_token_ids
from tests import model_zoo
from tests.conftest import WorkerLauncher, cli_env, start_cli

# the slow tier (make test-full, CI): starts a worker with the real model
pytestmark = pytest.mark.slow


def corpus() -> list[dict[str, object]]:
    """Varied texts: prose lines, lines joined past the model's 256 tokens (cut), a literal
    prompt on some (joined before the text, as the worker joins it)."""
    lines = [line for line in model_zoo.corpus_lines()[:400] if line.strip()][:160]
    long = [" ".join(lines[i : i + 40]) for i in range(0, 120, 40)]
    chunks: list[dict[str, object]] = [{"id": f"c{i}", "text": t} for i, t in enumerate(lines)]
    chunks += [{"id": f"long{i}", "text": t} for i, t in enumerate(long)]
    chunks += [{"id": f"p{i}", "text": t, "prompt": "query: "} for i, t in enumerate(lines[:10])]
    return chunks


@contextlib.contextmanager
def texts_tokenized(worker: Any) -> Iterator[set[str]]:
    """The texts the worker's tokenizer is called for while the block runs."""
    text = worker.encoder.text
    tokenized: set[str] = set()
    original = text.tokenize

    def counting(texts: Sequence[str], prompts: Sequence[str] | None = None, *more: Any) -> Any:
        tokenized.update(texts)
        return original(texts, prompts, *more)

    text.tokenize = counting
    try:
        yield tokenized
    finally:
        del text.tokenize


async def embed_run(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis, *, token_ids: bool
) -> tuple[dict[str, np.ndarray], float]:
    """One job enqueued before the worker starts (one window, the same batches each run), then
    embedded; its float32 vectors by id, and the share of the corpus's texts the worker's
    tokenizer was called for (the worker's own probes tokenize texts of their own)."""
    await client.flushdb()
    chunks = corpus()
    job = "ids" if token_ids else "text"
    async with Producer(settings, client) as producer:
        async with workers.run(settings) as worker:
            with texts_tokenized(worker) as tokenized:
                options = EmbeddingOptions(dtype="float32")
                await producer.enqueue(
                    chunks, job=job, options=options, token_ids=token_ids, reembed=True
                )
                progress = await producer.wait_for_job(job, timeout=300)
            assert progress.done == len(chunks) and progress.dead == 0, progress
        vectors = {r.id: r.vector for r in [r async for r in producer.results()]}
    wanted = {str(c["text"]) for c in chunks}
    return vectors, len(wanted & tokenized) / len(wanted)


async def test_vectors_from_producer_ids_are_bit_identical(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis
) -> None:
    # no slice limit: batches are then planned by the token budget alone, not by a cost model
    # fitted on this run's timings, so both runs compute the same batches
    unpacked = settings.model_copy(update={"vector_cache_mb": 0, "slice_ms": 0})
    from_text, tokenized_text = await embed_run(workers, unpacked, client, token_ids=False)
    from_ids, tokenized_ids = await embed_run(workers, unpacked, client, token_ids=True)
    assert set(from_ids) == set(from_text) == {c["id"] for c in corpus()}
    differing = [i for i in from_text if not np.array_equal(from_text[i], from_ids[i])]
    assert differing == [], f"{len(differing)} vectors differ, e.g. {differing[:5]}"
    assert tokenized_text == 1  # every text tokenized by the worker ...
    assert tokenized_ids == 0  # ... and none when the producer sent ids


async def test_ids_of_another_tokenizer_are_dead_lettered_and_refused_by_the_producer(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis
) -> None:
    async with Producer(settings, client) as producer, workers.run(settings) as worker:
        fingerprint = worker.encoder.text.fingerprint
        # any language: msgpack on the ingest stream, ids from a tokenizer of its own
        foreign = {
            "v": 1,
            "id": "foreign",
            "text": "hello world",
            "job": "foreign",
            "token_ids": pack_token_ids([101, 7592, 2088, 102]),
            "tokenizer": "t1-0123456789abcdef01234567",
        }
        out_of_vocabulary = {
            **foreign,
            "id": "oov",
            "tokenizer": fingerprint,
            "token_ids": pack_token_ids([101, 10**6, 102]),
        }
        right = {**foreign, "id": "right", "tokenizer": fingerprint}
        for message in (foreign, out_of_vocabulary, right):
            await client.xadd(
                settings.keys.ingest, {PAYLOAD_FIELD: msgpack.packb(message, use_bin_type=True)}
            )
        # what the producer's enqueue script counts for a job, done by hand for raw XADDs
        await client.hincrby(settings.keys.job("foreign"), "enqueued", 3)
        progress = await producer.wait_for_job("foreign", timeout=120)
        assert (progress.done, progress.dead) == (1, 2), progress
        dead = await client.xrange(settings.keys.dead)
        reasons = {
            fields[b"id"].decode(): (
                fields[b"reason"].decode(),
                fields[b"detail"].decode(),
            )
            for _, fields in dead
        }
        assert reasons["foreign"][0] == "tokenizer"
        assert "another tokenizer" in reasons["foreign"][1]
        assert fingerprint in reasons["foreign"][1]
        assert reasons["oov"][0] == "tokenizer"
        assert "outside the model's vocabulary" in reasons["oov"][1]
        # the producer says why before sending: the card names the model's tokenizer
        foreign_chunk = decode_chunk(msgpack.packb(foreign, use_bin_type=True))
        with pytest.raises(ValueError, match="another tokenizer"):
            await producer.enqueue([foreign_chunk], job="refused")


async def test_the_enqueue_command_sends_token_ids(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis
) -> None:
    lines = [line for line in model_zoo.corpus_lines()[:50] if line.strip()][:20]
    async with workers.run(settings) as worker:  # publishes the card and the tokenizer
        text = worker.encoder.text
    # with no worker reading, what the command sent stays on the stream to be read back
    payload = "".join(json.dumps({"id": f"l{i}", "text": t}) + "\n" for i, t in enumerate(lines))
    command = await start_cli(
        cli_env(settings),
        *("enqueue", "-", "--job", "cli", "--token-ids"),
        stdin=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(command.communicate(payload.encode()), 300)
    assert command.returncode == 0, err.decode()
    sent = [
        decode_chunk(fields[PAYLOAD_FIELD])
        for _, fields in await client.xrange(settings.keys.ingest)
    ]
    assert [chunk.id for chunk in sent] == [f"l{i}" for i in range(len(lines))]
    expected = text.tokenize([chunk.text for chunk in sent], None)
    for chunk, tokens in zip(sent, expected, strict=True):
        assert chunk.tokenizer == text.fingerprint
        assert chunk.token_ids is not None
        assert unpack_token_ids(chunk.token_ids) == tokens.ids


async def test_queries_and_requests_carry_ids_from_the_producer(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis
) -> None:
    """The query stream (few texts) and the interactive stream (many), as the gateway sends
    them with EMBEDFLEET_PRODUCER_TOKEN_IDS: the worker embeds the ids it was sent, and the
    vectors are those of the texts."""
    lines = [line for line in model_zoo.corpus_lines()[:80] if line.strip()][:40]
    with_ids = settings.model_copy(update={"producer_token_ids": True})
    async with workers.run(settings) as worker, Producer(with_ids, client) as producer:
        with texts_tokenized(worker) as tokenized:
            query = await producer.embed_query(lines[0], timeout=120)
            many = await producer.embed_texts(lines, timeout=120)
        assert not tokenized & set(lines)  # neither door had the worker tokenize
    expected = worker.encoder.embed_texts(lines)
    for found, reference in [(query, expected[0]), *zip(many, expected, strict=True)]:
        cosine = float(found @ reference / np.linalg.norm(found) / np.linalg.norm(reference))
        assert cosine >= 0.9999
