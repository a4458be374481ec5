"""Image chunks against a real Redis and the real worker (workers/images.py, issue 56): a CLIP or
SigLIP lane embeds images and texts of one job as ``get_image_features`` / ``get_text_features``
after the model's processor do, dead-letters each bad image with its reason and loses nothing
else; a lane whose model embeds text only refuses an image at the Producer, and dead-letters
one sent past it while the texts of its window come back."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aioredis

from embedfleet.producer.client import Producer
from embedfleet.shared.dead_letters import DeadLetter, DeadReason
from embedfleet.shared.exit_codes import ExitCode
from embedfleet.shared.options import ModalityError
from embedfleet.shared.protocol import PAYLOAD_FIELD, Chunk, encode_chunk
from embedfleet.shared.settings import Settings
from embedfleet.workers.model.encoder import Encoder
from tests import forks
from tests.conftest import WorkerLauncher, cli_env, until
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


def _embedfleet(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`embedfleet ARGS` as a user runs it."""
    return forks.run(args, text=True, env=env, timeout=300)


GOOD_IMAGES = 1_000  # the job: a thousand good images beside every bad one


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
    async with workers.run(encoder=encoder) as worker, Producer(settings, client) as producer:
        assert (await producer.model_card()).modalities == ("text", "image")
        await producer.enqueue(chunks, job="photos")
        await client.xadd(settings.keys.ingest, {PAYLOAD_FIELD: encode_chunk(too_big)})
        progress = await producer.wait_for_job("photos", timeout=300)
        results = {r.id: r.vector.astype(np.float32) async for r in producer.results(job="photos")}
        # the query stage embeds a text with the text tower; an image sent there is refused
        query = await producer.embed_query("a red bicycle", timeout=60)
        image_query = Chunk(id="q:0", image=pictures["img0"], reply="q")
        await client.xadd(settings.keys.query, {PAYLOAD_FIELD: encode_chunk(image_query)})

        async def all_dead_lettered() -> bool:
            return await client.xlen(settings.keys.dead) == len(bad) + 2

        await until(all_dead_lettered)
    assert progress.done == len(pictures) + len(texts) and progress.dead == len(bad)
    # the model's time on images counts in its busy share (embedfleet_model_seconds_total)
    assert worker.stats.embedded >= len(pictures) and worker.stats.model_seconds > 0
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


# --- `embedfleet enqueue` with images, and image rows in the stores (issue 56) ----------------
FOLDER_IMAGES = 50  # a folder's worth, nested two deep


def _photo_folder(root: Path) -> dict[str, bytes]:
    """A folder of images (ids: their paths relative to it) and, beside them, a file over the
    CLI's cap, one that does not decode and one that is not an image by its name."""
    photos: dict[str, bytes] = {}
    for i in range(FOLDER_IMAGES):
        fmt = FORMATS[i % 4]
        name = f"set{i % 3}/{'deep/' if i % 5 == 0 else ''}p{i:02d}.{fmt.lower()}"
        photos[name] = image_bytes(100 + i, (24 + i % 17, 40 - i % 13), fmt)
    files = {**photos, "huge.png": b"\x89PNG" + b"\0" * 30_000, "broken.png": b"not an image"}
    for name, data in {**files, "notes.txt": b"the photographer's notes"}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return photos


def _with_sink(settings: Settings, kind: str, directory: Path, postgres: str | None = None):
    from embedfleet.sinks import local_sink_url

    url = local_sink_url(kind, directory, postgres)
    return settings.model_copy(update={"sink": url, "sink_table": "images"})


def _stored(settings: Settings) -> dict[str, Any]:
    from embedfleet.sinks import open_backend, parse_sink_url

    with open_backend(parse_sink_url(settings.sink, settings.sink_table)) as backend:
        return {row.id: row for row in backend.export_rows()}


@pytest.mark.slow  # an `embedfleet` process
async def test_enqueue_images_embeds_a_folder_into_a_table_with_each_files_path(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis, models: Path, tmp_path
) -> None:
    from embedfleet.sinks import build_sink

    model_dir = dual_model_dir("clip", models)
    photos = _photo_folder(tmp_path / "photos")
    (tmp_path / "lines").mkdir()
    # the folder's p01 again: its vector comes from the workers' cache, with this line's ref
    (tmp_path / "lines" / "cat.jpeg").write_bytes(photos["set1/p01.jpeg"])
    inline = base64.b64encode(photos["set2/p02.webp"]).decode()
    (tmp_path / "lines" / "images.jsonl").write_text(
        '{"id": "cat", "image_path": "cat.jpeg", "meta": {"by": "line"}}\n'
        f'{{"id": "inline", "image": "data:image/webp;base64,{inline}", "image_ref": "scan 7"}}\n'
        '{"id": "gone", "image_path": "gone.png"}\n'
        '{"id": "caption", "text": "a red bicycle"}\n'
    )
    db = _with_sink(settings, "lancedb", tmp_path)
    env = cli_env(
        db,
        EMBEDFLEET_MAX_IMAGE_BYTES="20000",  # the CLI's cap: huge.png over it
        EMBEDFLEET_SINK=db.sink,
        EMBEDFLEET_SINK_TABLE=db.sink_table,
    )
    encoder = Encoder(str(model_dir), device="cpu", dtype="float32")
    async with workers.run(db, sink=build_sink(db, client), client=client, encoder=encoder):
        folder = await asyncio.to_thread(
            _embedfleet,
            "enqueue",
            "--images",
            str(tmp_path / "photos"),
            "--job",
            "pics",
            "--wait",
            "--json",
            env=env,
        )
        lines = await asyncio.to_thread(
            _embedfleet,
            "enqueue",
            str(tmp_path / "lines" / "images.jsonl"),
            "--job",
            "lines",
            "--wait",
            env=env,
        )
        # a text query through the text tower finds image rows, each printed with its path
        search = await asyncio.to_thread(
            _embedfleet, "search", "a red bicycle", "--k", "3", "--json", env=env
        )
    # the folder: every image sent, huge.png refused here, broken.png dead-lettered there
    assert folder.returncode == ExitCode.DEAD_LETTERS, folder.stderr
    report = json.loads(folder.stdout)
    assert (report["enqueued"], report["dead_lettered"]) == (FOLDER_IMAGES + 1, 1)
    assert [bad["file"] for bad in report["rejected_files"]] == [str(tmp_path / "photos/huge.png")]
    assert "over the 20000 limit (EMBEDFLEET_MAX_IMAGE_BYTES)" in folder.stderr
    assert "skipped 1 files not named as images" in folder.stderr
    assert lines.returncode == ExitCode.REJECTED_LINES, lines.stderr
    assert "enqueued 3 chunks as job 'lines'" in lines.stdout
    assert "line 3: " in lines.stderr and "gone.png: cannot be read" in lines.stderr
    rows = _stored(db)
    assert sorted(rows) == sorted([*photos, "cat", "inline", "caption"])
    # each image row holds where its image came from in place of a text, never its bytes
    assert {name: rows[name].text for name in photos} == {
        name: str(tmp_path / "photos" / name) for name in photos
    }
    assert (rows["cat"].text, rows["cat"].meta) == ("cat.jpeg", {"by": "line"})
    assert (rows["inline"].text, rows["caption"].text) == ("scan 7", "a red bicycle")
    names = sorted(photos)
    reference = reference_image_features(model_dir, [photos[name] for name in names])
    stored = np.stack([rows[name].vector.astype(np.float32) for name in names])
    assert min_cosine(stored, reference) >= 0.999  # fp16 in the table
    assert (
        min_cosine(
            rows["cat"].vector[None].astype(np.float32),
            reference[names.index("set1/p01.jpeg")][None],
        )
        >= 0.999
    )
    assert search.returncode == 0, search.stderr
    hits = [json.loads(line) for line in search.stdout.splitlines()]
    assert len(hits) == 3 and all(rows[hit["id"]].text == hit["text"] for hit in hits)
    ((_, fields),) = await client.xrange(settings.keys.dead)
    assert DeadLetter.from_fields("0-1", fields).chunk_id == "broken.png"


@pytest.mark.slow  # a database per store (PostgreSQL: a server)
@pytest.mark.parametrize("kind", ["pgvector", "qdrant-local", "parquet"])  # lancedb: above
async def test_an_image_row_keeps_its_reference_in_every_store(
    workers: WorkerLauncher,
    settings: Settings,
    client: aioredis.Redis,
    models: Path,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    kind: str,
) -> None:
    from embedfleet.sinks import build_sink
    from tests.conftest import running_pg

    postgres = None
    if kind == "pgvector":
        postgres = running_pg(request.getfixturevalue("pg_session_server")).get_uri()
    db = _with_sink(settings, kind, tmp_path, postgres)
    # a table of its own; a Parquet shard written as soon as its rows are in (not after 20 s)
    table = f"images_{uuid.uuid4().hex[:8]}"
    db = db.model_copy(update={"sink_table": table, "parquet_shard_rows": 3})
    encoder = Encoder(str(dual_model_dir("clip", models)), device="cpu", dtype="float32")
    chunks = [
        Chunk(id="ref", image=image_bytes(1), image_ref="s3://photos/cats/1.png"),
        Chunk(id="bare", image=image_bytes(2, fmt="JPEG")),  # no reference: no text
        Chunk(id="caption", text="a red bicycle"),
    ]
    async with (
        workers.run(db, sink=build_sink(db, client), client=client, encoder=encoder),
        Producer(db, client) as producer,
    ):
        await producer.enqueue(chunks, job="refs")
        progress = await producer.wait_for_job("refs", timeout=120)
    assert progress.done == len(chunks)
    rows = _stored(db)
    assert {name: row.text for name, row in rows.items()} == {
        "ref": "s3://photos/cats/1.png",
        "bare": None,
        "caption": "a red bicycle",
    }


@pytest.mark.slow  # an S3-compatible server (moto_server)
async def test_images_by_reference_are_read_from_allowed_places_only(
    workers: WorkerLauncher,
    settings: Settings,
    client: aioredis.Redis,
    models: Path,
    tmp_path: Path,
    s3_endpoint: str,
) -> None:
    from tests.conftest import BUCKET
    from tests.integration.sinks.parquet.test_sink import s3_filesystem

    model_dir = dual_model_dir("clip", models)
    pictures = {f"p{i}": image_bytes(200 + i, (30 + i, 50 - i), FORMATS[i % 4]) for i in range(6)}
    s3 = s3_filesystem(s3_endpoint)
    for name in ("p0", "p1", "p2"):
        with s3.open_output_stream(f"{BUCKET}/photos/{name}") as stream:
            stream.write(pictures[name])
    with s3.open_output_stream(f"{BUCKET}/private/p0") as stream:
        stream.write(pictures["p0"])
    folder = tmp_path / "photos"
    folder.mkdir()
    for name in ("p3", "p4", "p5"):
        (folder / name).write_bytes(pictures[name])
    (tmp_path / "secret.png").write_bytes(pictures["p3"])
    refs = {name: f"s3://{BUCKET}/photos/{name}" for name in ("p0", "p1", "p2")}
    refs |= {name: str(folder / name) for name in ("p3", "p4", "p5")}
    refused = {
        "missing": f"s3://{BUCKET}/photos/none",
        "other-prefix": f"s3://{BUCKET}/private/p0",
        "outside": str(tmp_path / "secret.png"),
    }
    lane = settings.model_copy(
        update={
            "image_sources": f"s3://{BUCKET}/photos/,{folder}",
            "s3_endpoint_url": s3_endpoint,
        }
    )
    chunks = [Chunk(id=name, image_ref=ref) for name, ref in {**refs, **refused}.items()]
    encoder = Encoder(str(model_dir), device="cpu", dtype="float32")
    async with workers.run(lane, encoder=encoder), Producer(lane, client) as producer:
        await producer.enqueue(chunks, job="refs")
        progress = await producer.wait_for_job("refs", timeout=120)
        results = {r.id: r.vector.astype(np.float32) async for r in producer.results(job="refs")}
    assert (progress.done, progress.dead) == (len(refs), len(refused))
    names = sorted(refs)
    reference = reference_image_features(model_dir, [pictures[name] for name in names])
    assert min_cosine(np.stack([results[name] for name in names]), reference) >= 0.9999
    dead = {
        letter.chunk_id: letter
        for letter in (DeadLetter.from_fields(i, f) for i, f in await client.xrange(lane.keys.dead))
    }
    assert {name: dead[name].reason for name in refused} == dict.fromkeys(
        refused, DeadReason.SOURCE
    )
    assert "no such object" in dead["missing"].detail
    assert "outside the places EMBEDFLEET_IMAGE_SOURCES allows" in dead["other-prefix"].detail
    assert "outside the places" in dead["outside"].detail
