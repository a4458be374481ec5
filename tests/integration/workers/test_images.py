"""Image chunks against a real Redis and the real worker (workers/images.py, issue 56): a CLIP or
SigLIP lane embeds images and texts of one job as ``get_image_features`` / ``get_text_features``
after the model's processor do, dead-letters each bad image with its reason and loses nothing
else; a lane whose model embeds text only refuses an image at the Producer, and dead-letters
one sent past it while the texts of its window come back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis

from embedfleet.producer.client import Producer
from embedfleet.shared.dead_letters import DeadLetter, DeadReason
from embedfleet.shared.options import ModalityError
from embedfleet.shared.protocol import PAYLOAD_FIELD, Chunk, encode_chunk
from embedfleet.shared.settings import Settings
from embedfleet.workers.model.encoder import Encoder
from tests.conftest import WorkerLauncher, until
from tests.image_models import (
    DUAL_FAMILIES,
    dual_model_dir,
    image_bytes,
    min_cosine,
    reference_image_features,
    reference_text_features,
)
from tests.unit.workers.test_images import png_claiming

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
GOOD_IMAGES = 200


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dual-worker")


@pytest.mark.parametrize("family", DUAL_FAMILIES)
async def test_a_dual_lane_embeds_images_and_texts_and_dead_letters_bad_images(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis, models: Path, family: str
) -> None:
    model_dir = dual_model_dir(family, models)
    encoder = Encoder(str(model_dir), device="cpu", dtype="float32")
    pictures = {
        f"img{i}": image_bytes(i, (20 + i % 37, 70 - i % 29), FORMATS[i % 4])
        for i in range(GOOD_IMAGES)
    }
    bad = {
        "garbage": b"not an image",
        "truncated": image_bytes(7, (64, 64), "PNG")[:300],
        "bomb": png_claiming(30_000, 30_000),
    }
    texts = {"t0": "a red bicycle", "t1": "What does the garbage collector do?"}
    chunks = [Chunk(id=i, image=data) for i, data in [*pictures.items(), *bad.items()]]
    chunks[10:10] = [Chunk(id=i, text=text) for i, text in texts.items()]
    too_big = Chunk(id="big", image=b"\x89PNG" + b"\0" * settings.max_image_bytes)
    async with workers.run(encoder=encoder), Producer(settings, client) as producer:
        assert (await producer.model_card()).modalities == ("text", "image")
        await producer.enqueue(chunks, job="photos")
        await client.xadd(settings.keys.ingest, {PAYLOAD_FIELD: encode_chunk(too_big)})
        progress = await producer.wait_for_job("photos", timeout=300)
        results = {r.id: r.vector.astype(np.float32) async for r in producer.results(job="photos")}
        # the query lane embeds a text with the text tower; an image sent there is refused
        query = await producer.embed_query("a red bicycle", timeout=60)
        image_query = Chunk(id="q:0", image=pictures["img0"], reply="q")
        await client.xadd(settings.keys.query, {PAYLOAD_FIELD: encode_chunk(image_query)})

        async def all_dead_lettered() -> bool:
            return await client.xlen(settings.keys.dead) == len(bad) + 2

        await until(all_dead_lettered)
    assert progress.done == len(pictures) + len(texts) and progress.dead == len(bad)
    assert sorted(results) == sorted([*pictures, *texts])
    ids = sorted(pictures)
    reference = reference_image_features(model_dir, [pictures[i] for i in ids])
    assert min_cosine(np.stack([results[i] for i in ids]), reference) >= 0.9999
    text_reference = reference_text_features(model_dir, list(texts.values()))
    assert min_cosine(np.stack([results[i] for i in texts]), text_reference) >= 0.9999
    assert min_cosine(query[None, :].astype(np.float32), text_reference[:1]) >= 0.9999
    dead = {
        letter.chunk_id: letter
        for letter in (
            DeadLetter.from_fields(i, f) for i, f in await client.xrange(settings.keys.dead)
        )
    }
    assert {name: dead[name].reason for name in [*bad, "big", "q:0"]} == {
        "q:0": DeadReason.OPTIONS,
        "garbage": DeadReason.INVALID,
        "truncated": DeadReason.INVALID,
        "bomb": DeadReason.TOO_LARGE,
        "big": DeadReason.TOO_LARGE,
    }
    assert "decompression bomb" in dead["bomb"].detail
    assert all(dead[name].replayable for name in bad)  # each kept whole, to replay


async def test_a_text_lane_dead_letters_an_image_and_embeds_its_texts(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis
) -> None:
    keys = settings.keys
    image = Chunk(id="photo", image=image_bytes(1))
    texts = [Chunk(id=f"t{i}", text=f"a text about {i} red bicycles") for i in range(5)]
    async with workers.run(), Producer(settings, client) as producer:
        with pytest.raises(ModalityError, match="embeds text only, not image input"):
            await producer.enqueue([image], job="refused")
        # past the Producer, as a client in another language may send it
        await client.xadd(keys.ingest, {PAYLOAD_FIELD: encode_chunk(image)})
        await producer.enqueue(texts, job="mixed")
        progress = await producer.wait_for_job("mixed", timeout=120)
        results = {r.id: r async for r in producer.results(job="mixed")}

        async def dead_lettered() -> bool:
            return await client.xlen(keys.dead) == 1

        await until(dead_lettered)
    assert progress.done == len(texts) and progress.dead == 0
    assert sorted(results) == sorted(chunk.id for chunk in texts)
    assert all(np.isfinite(r.vector.astype(np.float32)).all() for r in results.values())
    ((entry_id, fields),) = await client.xrange(keys.dead)
    dead = DeadLetter.from_fields(entry_id, fields)
    assert (dead.reason, dead.chunk_id) == (DeadReason.OPTIONS, "photo")
    assert "this model embeds text only, not image input" in dead.detail
