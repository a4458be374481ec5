"""loadtest.bench --images (loadtest/image_bench.py, issue 56) at tiny numbers: images new to
each round of mixed sizes and formats, and the whole run on the tiny CLIP model (a real server,
the in-process worker, sentence-transformers beside it) to its table and JSON."""

from __future__ import annotations

import io
import json
from pathlib import Path

from click.testing import CliRunner
from PIL import Image

from embedfleet.shared.settings import Settings
from loadtest.bench import main
from loadtest.image_bench import FORMATS, SIDES, ST, round_images
from tests.image_models import dual_model_dir


def test_each_round_gets_new_images_of_mixed_sizes_and_formats() -> None:
    first = round_images(12, 0, "round 1")
    assert round_images(12, 0, "round 1") == first  # seeded: the same run reads the same files
    assert not set(first) & set(round_images(12, 0, "round 2"))
    assert not set(first) & set(round_images(12, 1, "round 1"))
    opened = [Image.open(io.BytesIO(data)) for data in first]
    assert {image.format for image in opened} == set(FORMATS)
    sides = [side for image in opened for side in image.size]
    assert SIDES[0] <= min(sides) and max(sides) <= SIDES[1]
    assert len({image.size for image in opened}) > 8


def test_the_images_bench_runs_fleet_and_sentence_transformers_on_the_same_files(
    tmp_path: Path, settings: Settings
) -> None:
    out = tmp_path / "images.json"
    model = dual_model_dir("clip", tmp_path)
    arguments = ["--images", "6", "--rounds", "1", "--image-model", str(model)]
    arguments += ["--redis-url", settings.effective_redis_url, "--json-out", str(out)]
    result = CliRunner().invoke(main, arguments)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    rows = {row["name"]: row for row in report["rows"]}
    assert list(rows)[:2] == [ST, "fleet auto"]
    for row in rows.values():
        assert row["images_per_s"] > 0 and len(row["rates"]) == 1
        # the fleet embedded the files sentence-transformers did, to its vectors
        assert row["min_cosine_vs_st"] >= 0.999
    assert rows[ST]["ratio"] == 1.0
    assert report["decode_preprocess_per_cpu_s"] > 0
    assert "6 images" in report["images"]
    assert "| fleet auto |" in result.output
    assert "host decode + preprocess" in result.output


def test_the_latency_scenario_takes_an_image_bulk_load_on_a_clip_lane(tmp_path: Path) -> None:
    """loadtest.latency --images: the worker's model is the CLIP directory, the bulk chunks are
    images of the pool in turn, and the bulk rate counts chunks (an image has no tokens)."""
    from argparse import Namespace

    from loadtest.latency import CHUNKS, IMAGE_BACKLOG, IMAGE_POOL, TOKENS, bulk_corpus, image_load

    model = dual_model_dir("clip", tmp_path)
    args = Namespace(images=True, image_model=model, backlog=None)
    image_load(args, tmp_path)
    assert (args.image_model, args.bulk_metric, args.backlog) == (model, CHUNKS, IMAGE_BACKLOG)
    chunks = bulk_corpus(IMAGE_POOL + 3, args.bulk_images)
    assert [chunk.image for chunk in chunks[IMAGE_POOL:]] == list(args.bulk_images[:3])
    assert not any(chunk.text for chunk in chunks)
    assert len({chunk.id for chunk in chunks}) == len(chunks)
    texts = Namespace(images=False, image_model=model, backlog=None)
    image_load(texts, tmp_path)
    assert (texts.image_model, texts.bulk_images, texts.bulk_metric) == (None, (), TOKENS)
    assert all(chunk.image is None and chunk.text for chunk in bulk_corpus(5, texts.bulk_images))
