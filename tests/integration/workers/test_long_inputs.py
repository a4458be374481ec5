"""Long inputs embedded whole (issue 42), through a real worker with the packaged model
(all-MiniLM-L6-v2, 256 tokens): a 3,000-token text sent with ``window_overlap`` comes back as
one vector equal (cosine >= 0.999) to the by-hand reference, on every door of the worker (the
ingest stream from ``Producer.enqueue`` and from the ``embedfleet enqueue`` command, the
interactive stream, the query stream), and
costs one forward row per window, planned in the same batches as the other texts.

The reference is written here from the model's own parts, not from the worker's code: the
model's tokenizer, windows of 254 text tokens between [CLS] and [SEP] stepping by 254 - overlap,
``SentenceTransformer``'s Transformer and Pooling modules (no Normalize) on each window, the
mean weighted by each window's tokens, then normalised.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import numpy as np
import pytest
import redis.asyncio as aioredis

from embedfleet.producer.client import EmbeddingOptions, Producer
from embedfleet.shared.settings import Settings
from tests import model_zoo
from tests.conftest import WorkerLauncher, cli_env, start_cli

# the slow tier (make test-full, CI): starts a worker with the real model
pytestmark = pytest.mark.slow

OVERLAP = 32
MIN_COSINE = 0.999


def long_text(count_tokens: Callable[[str], int], tokens: int = 3000) -> str:
    """Help-topic prose joined until ``count_tokens`` says it is at least ``tokens`` tokens."""
    lines, text = model_zoo.corpus_lines(), ""
    for line in lines:
        text = f"{text} {line}".strip()
        if len(text) > tokens * 3 and count_tokens(text) >= tokens:
            return text
    raise AssertionError("the corpus is too short")


def token_counter(model_dir: str) -> Callable[[str], int]:
    """A text's whole token count (special tokens in) with the model's own tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return lambda text: len(tokenizer(text, truncation=False)["input_ids"])


def by_hand(model_dir: str, text: str, overlap: int) -> tuple[np.ndarray, int]:
    """The reference vector and its number of windows (see the module docstring)."""
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_dir, device="cpu")
    limit = model.max_seq_length
    ids = model.tokenizer(text, truncation=False)["input_ids"]
    cls, body, sep = ids[0], ids[1:-1], ids[-1]
    room = limit - 2
    pooled, weights, start = [], [], 0
    while True:
        window = [cls, *body[start : start + room], sep]
        features = {
            "input_ids": torch.tensor([window]),
            "attention_mask": torch.ones(1, len(window), dtype=torch.int64),
        }
        with torch.inference_mode():
            pooled.append(model[1](model[0](features))["sentence_embedding"][0].numpy())
        weights.append(len(window))
        if start + room >= len(body):
            break
        start += room - overlap
    mean = np.average(np.stack(pooled), axis=0, weights=weights)
    return mean / np.linalg.norm(mean), len(pooled)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


async def test_a_long_text_is_embedded_whole_on_every_door(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis, encoder
) -> None:
    text = long_text(token_counter(str(encoder.model_dir)))
    reference, windows = by_hand(str(encoder.model_dir), text, OVERLAP)
    assert windows >= 12  # 3,000 tokens in windows of 254 stepping by 222
    short = [line for line in model_zoo.corpus_lines()[:40] if len(line) > 20][:20]
    cut = encoder.embed_texts([text])[0]  # what the worker gives without the option
    options = EmbeddingOptions(dtype="float32", window_overlap=OVERLAP)
    async with Producer(settings, client) as producer:
        async with workers.run(settings) as worker:
            chunks = [{"id": "long", "text": text}] + [
                {"id": f"s{i}", "text": line} for i, line in enumerate(short)
            ]
            await producer.enqueue(chunks, job="long", options=options)
            progress = await producer.wait_for_job("long", timeout=300)
            stats = worker.stats
            assert progress.done == len(chunks) and progress.dead == 0
            # one forward row per window, in the same batches as the short texts: the window's
            # rows are the short texts and the long one's windows, and no more batches than
            # one window of that many rows plans
            assert stats.embedded == len(short) + windows
            batches = stats.batches
            # (rows, longest row) per bulk batch, as the worker planned them
            shapes = [(rows, longest) for *_, rows, longest in worker.listener.slices]
            interactive = (await producer.embed_texts([text, short[0]], options=options))[0]
            # `embedfleet enqueue --window-overlap`, the command line's door to the same field
            line = json.dumps({"id": "cli-long", "text": text, "dtype": "float32"}) + "\n"
            command = await start_cli(
                cli_env(settings),
                *("enqueue", "-", "--job", "cli", "--window-overlap", str(OVERLAP), "--wait"),
                stdin=asyncio.subprocess.PIPE,
            )
            _, err = await asyncio.wait_for(command.communicate(line.encode()), 300)
            assert command.returncode == 0, err.decode()
            query = await producer.embed_query(text, options=options, timeout=120)
        results = {r.id: r async for r in producer.results()}
    assert set(results) == {c["id"] for c in chunks} | {"cli-long"}  # one result per input
    ingest = results["long"].vector
    assert results["long"].truncated is False
    doors = {
        "ingest": ingest,
        "enqueue command": results["cli-long"].vector,
        "interactive": interactive,
        "query": query,
    }
    for door, vector in doors.items():
        agreement = cosine(vector, reference)
        print(f"LONG INPUT {door}: cosine to the by-hand reference {agreement:.6f}")
        assert agreement >= MIN_COSINE, door
    # the short texts batched with the windows (computed before Normalize, normalised after)
    # are the vectors they are alone
    alone = encoder.embed_texts(short)
    for i, expected in enumerate(alone):
        assert cosine(results[f"s{i}"].vector, expected) >= 0.9999, i
        assert abs(float(np.linalg.norm(results[f"s{i}"].vector)) - 1.0) < 1e-4
    # and the whole text is not its first window: the option changed the vector
    assert cosine(ingest, cut) < 0.99
    print(
        f"LONG INPUT cost: {len(short)} short texts + 1 text of {windows} windows -> "
        f"{len(short) + windows} forward rows in {batches} batches (rows x longest: {shapes})"
    )


async def test_an_overlap_without_room_is_refused(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis, encoder
) -> None:
    """An overlap that leaves a window no room to advance is dead-lettered as an option the
    model cannot honour; the good chunk beside it is embedded."""
    text = long_text(token_counter(str(encoder.model_dir)), 600)
    async with Producer(settings, client) as producer:
        async with workers.run(settings):
            await producer.enqueue(
                [
                    {"id": "no-room", "text": text, "window_overlap": 254},
                    {"id": "fine", "text": text, "window_overlap": 0},
                ],
                job="room",
            )
            progress = await producer.wait_for_job("room", timeout=300)
        assert (progress.done, progress.dead) == (1, 1)
    letters = await client.xrange(settings.keys.dead)
    assert any(b"window_overlap=254 leaves no room" in b"".join(f.values()) for _, f in letters)
