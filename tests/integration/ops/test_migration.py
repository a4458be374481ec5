"""embedfleet/ops/migration.py against a real Redis: a migration of a table whose lane embeds
images is refused before anything is written (its image rows hold references, not images, and
a migration re-embeds stored texts); the end-to-end migrations are tests/end_to_end/."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis.asyncio as aioredis

from embedfleet.ops.migration import MigrationError, start
from embedfleet.shared.modelcard import ModelCard, publish_card
from embedfleet.shared.settings import Settings
from embedfleet.sinks import local_sink_url, parse_sink_url


async def test_a_table_of_an_image_lane_is_not_migrated(
    settings: Settings, client: aioredis.Redis, tmp_path: Path
) -> None:
    sink = parse_sink_url(local_sink_url("lancedb", tmp_path), "photos")
    dual = ModelCard(
        name="clip", dim=16, max_length=77, normalize=False, modalities=("text", "image")
    )
    await publish_card(client, settings.keys, dual)
    before = await client.dbsize()
    with pytest.raises(MigrationError, match="which embeds images: its image rows hold where"):
        await start(
            settings, client, sink, source="photos", target="v2", target_lane="b", alias=None
        )
    assert await client.dbsize() == before  # no record, no dual write
    assert not (tmp_path / "lancedb").exists()  # the table was not even opened
