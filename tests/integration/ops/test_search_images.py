"""`embedfleet search` across text and images (issue 56): on a table of image rows a text query,
embedded by the CLIP lane's text tower, finds the image rows in the order of their cosines to
``get_text_features``, each shown by its image ref; `--image PATH` embeds the file with the image
tower (the interactive stream) and finds image rows, and text rows on the same shared space, in
the order the reference features give. The refusals: TEXT and --image together or neither, a
missing, empty or oversized file, a file the worker cannot decode, and a text-only model's card.

One in-process worker (the tiny random-weight CLIP model of tests/image_models.py) writes a real
LanceDB table on a real Redis; the CLI runs in this process (click's runner, in a thread)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis
from click.testing import CliRunner, Result

from embedfleet.cli import main
from embedfleet.ops.search import snippet
from embedfleet.producer.client import Producer
from embedfleet.shared.modelcard import publish_card
from embedfleet.shared.protocol import Chunk
from embedfleet.shared.settings import Settings
from embedfleet.workers.model.encoder import Encoder
from tests.cards import tiny_card
from tests.conftest import WorkerLauncher, cli_env
from tests.image_models import (
    dual_model_dir,
    image_bytes,
    reference_image_features,
    reference_text_features,
)

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
QUERY = "a red bicycle"
CAPTIONS = [
    "a red bicycle leaning on a wall",
    "a cat asleep on a sofa",
    "two boats in a harbour at dawn",
    "a plate of pasta with basil",
    "snow on a mountain ridge",
    "a child flying a kite",
    "an old map of the city",
    "a dog catching a ball",
    "rain on a window at night",
    "a bowl of green apples",
]
TOLERANCE = 5e-3  # a stored vector is float16; the query float32 (cos >= 0.9999 to reference)


def _search(env: dict[str, str], *args: str) -> Result:
    """`embedfleet search ARGS` in this process (stdout and stderr apart)."""
    return CliRunner().invoke(main, ["search", *args], env=env)


def _cosines(query: np.ndarray, rows: np.ndarray) -> np.ndarray:
    return (rows @ query) / (np.linalg.norm(rows, axis=1) * np.linalg.norm(query))


def _check_ranking(result: Result, ids: list[str], cosines: np.ndarray) -> list[dict]:
    """``result``'s JSON hits: every row of ``ids``, each scored its reference cosine, nearest
    first by the reference (only two rows closer than the tolerance may change places)."""
    assert result.exit_code == 0, result.output
    hits = [json.loads(line) for line in result.stdout.splitlines()]
    assert sorted(hit["id"] for hit in hits) == sorted(ids)
    wanted = dict(zip(ids, cosines.tolist(), strict=True))
    assert all(abs(hit["score"] - wanted[hit["id"]]) < TOLERANCE for hit in hits), hits
    ranked = [wanted[hit["id"]] for hit in hits]
    assert all(a > b - 2 * TOLERANCE for i, a in enumerate(ranked) for b in ranked[i + 1 :])
    return hits


@pytest.mark.slow  # a worker (in process) and a LanceDB table
async def test_a_text_finds_image_rows_and_an_image_finds_image_and_text_rows(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis, tmp_path: Path
) -> None:
    from embedfleet.sinks import build_sink, local_sink_url

    model_dir = dual_model_dir("clip", tmp_path)
    photos = {
        f"p{i}": image_bytes(300 + i, (30 + 3 * i, 44 - 2 * i), FORMATS[i % 4]) for i in range(10)
    }
    paths = {
        name: tmp_path / "photos" / f"{name}.{FORMATS[i % 4].lower()}"
        for i, name in enumerate(photos)
    }
    (tmp_path / "photos").mkdir()
    for name, data in photos.items():
        paths[name].write_bytes(data)
    query_image = tmp_path / "query.png"  # in no row
    query_image.write_bytes(image_bytes(999, (36, 36)))
    (tmp_path / "broken.png").write_bytes(b"not an image")
    ids = list(photos)
    images = reference_image_features(model_dir, [*photos.values(), query_image.read_bytes()])
    texts = reference_text_features(model_dir, [QUERY, *CAPTIONS])
    db = settings.model_copy(
        update={"sink": local_sink_url("lancedb", tmp_path), "sink_table": "pictures"}
    )
    env = cli_env(db, EMBEDFLEET_SINK=db.sink, EMBEDFLEET_SINK_TABLE="pictures")
    # a lane whose card says it embeds text only (no worker: the card refuses first)
    await publish_card(
        client, settings.model_copy(update={"model_lane": "texts"}).keys, tiny_card()
    )
    encoder = Encoder(str(model_dir), device="cpu", dtype="float32")
    async with (
        workers.run(db, sink=build_sink(db, client), client=client, encoder=encoder),
        Producer(db, client) as producer,
    ):
        pictures = [Chunk(id=n, image=photos[n], image_ref=str(paths[n])) for n in ids]
        await producer.enqueue(pictures, job="photos")
        assert (await producer.wait_for_job("photos", timeout=120)).done == len(ids)
        by_text = await asyncio.to_thread(_search, env, QUERY, "--k", "10", "--json")
        shown = await asyncio.to_thread(_search, env, QUERY, "--k", "3")
        by_image = await asyncio.to_thread(_search, env, "--image", str(query_image), "--json")
        broken = await asyncio.to_thread(_search, env, "--image", str(tmp_path / "broken.png"))
        text_only = await asyncio.to_thread(
            _search, {**env, "EMBEDFLEET_MODEL_LANE": "texts"}, "--image", str(query_image)
        )
        # the same ids re-ingested as captions: each row replaced, the table now of texts
        captions = [Chunk(id=n, text=c) for n, c in zip(ids, CAPTIONS, strict=True)]
        await producer.enqueue(captions, job="captions")
        assert (await producer.wait_for_job("captions", timeout=120)).done == len(ids)
        on_texts = await asyncio.to_thread(_search, env, "--image", str(query_image), "--json")
    # a text query through the text tower: the image rows, each with its ref for a text
    hits = _check_ranking(by_text, ids, _cosines(texts[0], images[: len(ids)]))
    assert [hit["text"] for hit in hits] == [str(paths[hit["id"]]) for hit in hits]
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    assert len(lines) == 3
    for line, hit in zip(lines, hits, strict=False):
        assert hit["id"] in line and snippet(hit["text"]) in line and paths[hit["id"]].name in line
    # an image through the image tower: image rows, then a table of texts on the same space
    _check_ranking(by_image, ids, _cosines(images[-1], images[: len(ids)]))
    hits = _check_ranking(on_texts, ids, _cosines(images[-1], texts[1:]))
    assert {hit["id"]: hit["text"] for hit in hits} == dict(zip(ids, CAPTIONS, strict=True))
    # refused: a file the worker cannot decode (the file's fault), a text-only model (its card)
    assert broken.exit_code == 2 and "Invalid value for '--image'" in broken.stderr
    assert "broken.png: the worker could not embed it" in broken.stderr
    assert text_only.exit_code == 1, text_only.output
    assert "this model embeds text only, not image input" in text_only.stderr
    assert f"--image {query_image}" in text_only.stderr
    assert isinstance(text_only.exception, SystemExit)  # the CLI's error, not a crash


def test_search_takes_text_or_one_readable_image_within_the_cap(tmp_path: Path) -> None:
    """The refusals before anything is asked of Redis or a worker: TEXT and --image together
    or neither (usage), --image with --hybrid, and a file missing, a folder, empty or over
    EMBEDFLEET_MAX_IMAGE_BYTES (a bad --image naming the file, and the limit)."""
    env = {
        "EMBEDFLEET_SINK": f"lancedb://{tmp_path / 'db'}",
        "EMBEDFLEET_REDIS_URL": "redis://127.0.0.1:1",  # never reached
        "EMBEDFLEET_MAX_IMAGE_BYTES": "1000",
    }
    photo = tmp_path / "photo.png"
    photo.write_bytes(image_bytes(1, (8, 8)))
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "huge.png").write_bytes(b"\x89PNG" + b"\0" * 2000)
    usage = {
        ("a red bicycle", "--image", str(photo)): "not both",
        (): "give TEXT to search for, or --image PATH",
        ("--image", str(photo), "--hybrid"): "--hybrid takes TEXT",
    }
    for args, words in usage.items():
        result = _search(env, *args)
        assert result.exit_code == 2 and words in result.stderr, (args, result.output)
    bad = {
        "gone.png": "gone.png: cannot be read: No such file or directory",
        "empty.png": "empty.png: an empty file",
        "huge.png": "huge.png: 2004 bytes, over the 1000 limit (EMBEDFLEET_MAX_IMAGE_BYTES)",
        ".": "is a directory",
    }
    for name, words in bad.items():
        result = _search(env, "--image", str(tmp_path / name))
        assert result.exit_code == 2 and "Invalid value for '--image'" in result.stderr
        assert words in result.stderr, (name, result.stderr)


def test_a_snippet_keeps_the_end_of_a_long_ref_where_the_file_name_is() -> None:
    ref = "s3://photos/" + "2024/" * 20 + "red-bicycle.jpg"
    assert snippet(ref) == "…" + ref[-71:] and len(snippet(ref)) == 72
    assert snippet("a red bicycle " * 10).endswith(" a red bicycle…")  # a text: at a word
    assert snippet(None) == "(no text or image ref stored)"  # an image sent without a ref
