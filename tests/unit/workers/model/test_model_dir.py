"""workers/model/model_dir.py: the spec read from a model directory (the packaged one, copies of
its files changed), what it refuses with the module it names, a directory's revision, and the
sentence head after pooling."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from embedfleet.shared.model_path import resolve_model_path
from embedfleet.shared.settings import PACKAGED_MODEL
from embedfleet.workers.model.model_dir import (
    DenseSpec,
    ModelSpec,
    SentenceHead,
    UnsupportedModelError,
    directory_revision,
    head_normalizes,
    read_model_spec,
)

PACKAGED = resolve_model_path(PACKAGED_MODEL)


def copy_of_the_packaged_files(into: Path) -> Path:
    """The packaged model's configuration files, without its weights (the spec reads none)."""
    model = into / "model"
    shutil.copytree(PACKAGED, model, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    return model


def test_the_packaged_models_spec() -> None:
    spec = read_model_spec(PACKAGED)
    assert spec.transformer_dir == PACKAGED
    assert (spec.pooling_modes, spec.normalize, spec.max_seq_length) == (("mean",), True, 256)
    assert (spec.representation, spec.token_heads, spec.dense) == ("dense", None, ())
    assert spec.output_dim(384) == 384


def test_a_directory_without_pooling_is_refused_naming_the_module(tmp_path: Path) -> None:
    model = copy_of_the_packaged_files(tmp_path)
    modules = json.loads((model / "modules.json").read_text())
    without_pooling = [m for m in modules if "Pooling" not in m["type"]]
    (model / "modules.json").write_text(json.dumps(without_pooling))
    with pytest.raises(
        UnsupportedModelError, match=r"module 1 .*Normalize must come after Pooling"
    ):
        read_model_spec(model)
    (model / "modules.json").write_text(json.dumps(without_pooling[:1]))
    with pytest.raises(UnsupportedModelError, match=r"modules\.json has no Pooling module"):
        read_model_spec(model)


def test_a_model_type_other_than_sentence_transformer_is_refused(tmp_path: Path) -> None:
    model = copy_of_the_packaged_files(tmp_path)
    (model / "config_sentence_transformers.json").write_text(json.dumps({"model_type": "Other"}))
    with pytest.raises(UnsupportedModelError, match="model_type='Other'"):
        read_model_spec(model)


def test_a_plain_hugging_face_directory_is_mean_pooled(tmp_path: Path) -> None:
    model = copy_of_the_packaged_files(tmp_path)
    (model / "modules.json").unlink()
    spec = read_model_spec(model)
    assert (spec.pooling_modes, spec.normalize, spec.dense) == (("mean",), False, ())


def test_a_snapshots_revision_is_its_commit() -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    assert directory_revision(Path(f"/cache/models--a--b/snapshots/{commit}")) == f"hf:{commit}"


def test_a_folders_revision_is_a_digest_of_its_bytes(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"aaaa")
    first = directory_revision(tmp_path)
    assert first.startswith("blake2b:")
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "lock").write_text("ignored")
    assert directory_revision(tmp_path) == first, "hidden folders are not the model"
    (tmp_path / "weights.bin").write_bytes(b"aaab")  # same size, other bytes
    assert directory_revision(tmp_path) != first


def test_the_sentence_head_applies_dense_then_normalize_unless_told_not_to() -> None:
    dense = DenseSpec(
        path="2_Dense",
        weight=torch.tensor([[2.0, 0.0], [0.0, 1.0]]),
        bias=torch.tensor([0.0, 1.0]),
        activation="Identity",
        residual=None,
        use_residual=False,
    )
    spec = ModelSpec(transformer_dir=Path("."), dense=(dense,), normalize=True)
    assert spec.output_dim(384) == 2, "the last Dense module's width"
    head = SentenceHead(spec)
    pooled = torch.tensor([[1.5, 3.0]])
    with torch.no_grad():
        torch.testing.assert_close(head(pooled), torch.tensor([[0.6, 0.8]]))
        with head_normalizes(False):
            torch.testing.assert_close(head(pooled), torch.tensor([[3.0, 4.0]]))
        torch.testing.assert_close(head(pooled), torch.tensor([[0.6, 0.8]]), msg="set back")
