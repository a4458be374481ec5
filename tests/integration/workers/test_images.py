"""Image chunks against a real Redis and the real worker (workers/images.py, issue 56): a lane
whose model embeds text only refuses an image at the Producer, and an image sent past it (a
client in another language) is dead-lettered with its reason while the texts of its window
come back."""

from __future__ import annotations

import numpy as np
import pytest
import redis.asyncio as aioredis

from embedfleet.producer.client import Producer
from embedfleet.shared.dead_letters import DeadLetter, DeadReason
from embedfleet.shared.options import ModalityError
from embedfleet.shared.protocol import PAYLOAD_FIELD, Chunk, encode_chunk
from embedfleet.shared.settings import Settings
from tests.conftest import WorkerLauncher, until
from tests.image_models import image_bytes


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
