"""Tiny random-weight dual encoders (CLIP, SigLIP) and test images, built in seconds, no hub.

Each model: a ``transformers`` config (2 layers, hidden 32, 32-pixel images in 8-pixel patches),
random weights, the WordPiece tokenizer tests/model_zoo.py trains on Python's own help text, and
the model's PIL image processor, saved as a Hugging Face directory the way a published
``openai/clip-*`` or ``google/siglip-*`` snapshot lies on disk.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image

from tests.model_zoo import _fast_tokenizer, family_seed, wide_random_model

DUAL_FAMILIES = ("clip", "siglip")
TEXT_POSITIONS = 32
IMAGE_SIZE = 32


def _tower_sizes() -> dict[str, int]:
    return dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


def _text_config(
    tokenizer: transformers.PreTrainedTokenizerFast, positions: int, sizes: dict[str, int]
) -> dict[str, int]:
    return dict(
        vocab_size=len(tokenizer),
        max_position_embeddings=positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.cls_token_id,
        # CLIP pools its text at the first end-of-text token: the tokenizer's [SEP]
        eos_token_id=tokenizer.sep_token_id,
        **sizes,
    )


def _config(family: str, tokenizer: transformers.PreTrainedTokenizerFast) -> object:
    text = _text_config(tokenizer, TEXT_POSITIONS, _tower_sizes())
    vision = dict(image_size=IMAGE_SIZE, patch_size=8, **_tower_sizes())
    if family == "clip":
        return transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    return transformers.SiglipConfig(text_config=text, vision_config=vision)


def _processor(family: str) -> object:
    if family == "clip":  # resize the shortest edge, then crop the centre, as CLIP does
        return transformers.CLIPImageProcessorPil(
            size={"shortest_edge": IMAGE_SIZE},
            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        )
    return transformers.SiglipImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})


def _test_tokenizer(positions: int) -> transformers.PreTrainedTokenizerFast:
    tokenizer = _fast_tokenizer("bert")
    tokenizer.model_max_length = positions
    return tokenizer


def dual_model_dir(family: str, root: Path) -> Path:
    """A ``CLIPModel`` or ``SiglipModel`` directory under ``root`` (built once per root)."""
    target = root / f"dual-{family}"
    if (target / "config.json").is_file():
        return target
    tokenizer = _test_tokenizer(TEXT_POSITIONS)
    model_class = transformers.CLIPModel if family == "clip" else transformers.SiglipModel
    model = wide_random_model(model_class, _config(family, tokenizer), family_seed(family))
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    _processor(family).save_pretrained(target)  # type: ignore[attr-defined]
    return target


@dataclass(frozen=True)
class ClipShape:
    """A CLIP model's sizes: each tower's hidden / intermediate / layers / heads, the image and
    patch sides in pixels, the text positions and the shared projection's width."""

    vision: dict[str, int]
    text: dict[str, int]
    image_size: int
    patch_size: int
    text_positions: int
    projection_dim: int


def _sizes(hidden: int, layers: int, heads: int) -> dict[str, int]:
    return dict(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
    )


# openai/clip-vit-base-patch32's shapes (4.4 GFLOP per image in its vision tower)
VIT_B_32 = ClipShape(
    vision=_sizes(768, 12, 12),
    text=_sizes(512, 12, 8),
    image_size=224,
    patch_size=32,
    text_positions=77,
    projection_dim=512,
)
# openai/clip-vit-large-patch14's shapes (the 224-pixel one: 257 tokens a picture, about 162
# GFLOP per image in its vision tower), the device check's images step (loadtest/gpu_steps.py)
VIT_L_14 = replace(
    VIT_B_32,
    vision=_sizes(1024, 24, 16),
    text=_sizes(768, 12, 12),
    patch_size=14,
    projection_dim=768,
)


def clip_shaped_dir(
    target: Path,
    shape: ClipShape = VIT_B_32,
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
) -> Path:
    """A ``CLIPModel`` directory of ``shape``'s sizes with transformers' own random
    initialisation, the test tokenizer and a ``CLIPImageProcessor`` (resize the shortest edge,
    crop the centre, as a published ``openai/clip-*`` snapshot's), for speed runs only
    (loadtest.bench --images, the device check's images step): nothing downloaded. Built on
    ``device`` and saved in ``dtype`` (None: float32), as ``bert_shaped_dir`` does for the
    device check (ViT-L/14 is 1.7 GB in float32: built on the GPU, saved in half). Made once,
    kept when it is there."""
    if (target / "config.json").is_file():
        return target
    tokenizer = _test_tokenizer(shape.text_positions)
    config = transformers.CLIPConfig(
        text_config=_text_config(tokenizer, shape.text_positions, shape.text),
        vision_config=dict(
            image_size=shape.image_size, patch_size=shape.patch_size, **shape.vision
        ),
        projection_dim=shape.projection_dim,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.CLIPModel(config)
    if dtype is not None:
        torch.nn.Module.to(model, dtype)  # (transformers' own `to` is typed for devices only)
    model.eval().save_pretrained(target)
    tokenizer.save_pretrained(target)
    transformers.CLIPImageProcessor(
        size={"shortest_edge": shape.image_size},
        crop_size={"height": shape.image_size, "width": shape.image_size},
    ).save_pretrained(target)
    return target


def image_bytes(seed: int, size: tuple[int, int] = (48, 40), fmt: str = "PNG") -> bytes:
    """An encoded image of random pixels: ``fmt`` (PNG, JPEG, WEBP, GIF) at ``size``."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def reference_image_features(model_dir: Path, images: list[bytes]) -> np.ndarray:
    """What ``get_image_features`` answers after the model's own image processor: the parity
    reference, computed with transformers alone."""
    family = "clip" if "clip" in model_dir.name else "siglip"
    model_class = transformers.CLIPModel if family == "clip" else transformers.SiglipModel
    processor_class = (
        transformers.CLIPImageProcessorPil
        if family == "clip"
        else transformers.SiglipImageProcessorPil
    )
    model = model_class.from_pretrained(model_dir).eval()
    processor = processor_class.from_pretrained(model_dir)
    opened = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    pixels = processor(images=opened, return_tensors="pt")["pixel_values"]
    with torch.inference_mode():
        output = model.get_image_features(pixel_values=pixels)
    return np.asarray(output.pooler_output.float().numpy())


def reference_text_features(model_dir: Path, texts: list[str]) -> np.ndarray:
    """What ``get_text_features`` answers after the model's tokenizer, padded as its processor
    pads (SigLIP: to its fixed length, without a mask)."""
    siglip = "siglip" in model_dir.name
    model_class = transformers.SiglipModel if siglip else transformers.CLIPModel
    model = model_class.from_pretrained(model_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    padding = "max_length" if siglip else True
    encoded = tokenizer(
        texts, padding=padding, truncation=True, max_length=TEXT_POSITIONS, return_tensors="pt"
    )
    inputs = {"input_ids": encoded["input_ids"]}
    if not siglip:
        inputs["attention_mask"] = encoded["attention_mask"]
    with torch.inference_mode():
        output = model.get_text_features(**inputs)
    return np.asarray(output.pooler_output.float().numpy())


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The smallest row-wise cosine between two matrices of vectors."""
    dots = (a * b).sum(axis=1)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return float((dots / norms).min())


def sentence_transformers_dual_dir(family: str, root: Path, *, normalize: bool = False) -> Path:
    """The dual encoder of :func:`dual_model_dir` saved by sentence-transformers itself (its
    Transformer module with text and image modalities; ``normalize``: a Normalize after it)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules import Normalize

    target = root / f"st-dual-{family}{'-normalized' if normalize else ''}"
    if not (target / "modules.json").is_file():
        modules: list[torch.nn.Module] = [Transformer(str(dual_model_dir(family, root)))]
        if normalize:
            modules.append(Normalize())
        SentenceTransformer(modules=modules, device="cpu").save(
            str(target), create_model_card=False
        )
    return target
