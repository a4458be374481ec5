"""Images among a request's inputs: base64 data URIs made into the bytes an image chunk carries.

/v1/embeddings, TEI's /embed and Infinity's /embeddings_image take an image as a base64 data URI,
``data:image/png;base64,...`` (``image/jpeg``, ``image/webp``, ``image/gif`` too), as Infinity
does. A string that starts with ``data:image/`` is an image; every other string is text (on a
CLIP or SigLIP lane, embedded by the text tower). On a lane whose model card says it embeds
images (``modalities``) the image becomes a chunk's ``image`` (shared/protocol.py
``Chunk.image``); on a lane whose model embeds text only it is refused with the options
verifier's rule (``check_modality``: 400), never embedded as text. Before any worker has
published the card nothing here can tell: the image goes, and the worker answers for its model.

Checked here is the form alone: the type, base64 (the standard alphabet, padded, nothing else
in it), at most EMBEDFLEET_MAX_IMAGE_BYTES once decoded (an oversized one is refused from its
length, before it is decoded). Whether the bytes are an image is the worker's check
(workers/images.py): an undecodable or truncated file, or a decompression bomb, comes back as
the worker's refusal (gateway/embedder.py: 400 ``input_rejected``, TEI's 422). Nothing is
fetched: /embeddings_image, whose every input is an image, refuses an http(s) URL (the gateway
sends nothing anywhere); on /v1/embeddings and /embed a URL is text.

Decoding a body of them is a thread's work: the routes call these off the event loop.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence

from embedfleet.gateway.errors import APIError
from embedfleet.shared.options import ModalityError, check_modality

DATA_URI_PREFIX = "data:image/"
# a data URI's image type, by its subtype: the formats the worker decodes (shared/protocol.py
# IMAGE_FORMATS); ``jpg`` is not registered but is what some clients write
IMAGE_TYPES = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "webp": "WEBP", "gif": "GIF"}
REMOTE_PREFIXES = ("http://", "https://")
ACCEPTED_TYPES = "image/png, image/jpeg, image/webp or image/gif"

# an input as it goes to the fleet: a text, or an image's encoded bytes
Input = str | bytes


def is_image_uri(item: str) -> bool:
    """Whether a string input is an image: a data URI of an ``image/`` type (the scheme and
    type in any case, as URIs are read)."""
    return item[: len(DATA_URI_PREFIX)].lower() == DATA_URI_PREFIX


def decode_data_uri(uri: str, max_bytes: int, param: str = "input", index: int = 0) -> bytes:
    """The encoded image of ``data:image/<type>[;...];base64,<data>``: 400 ``invalid_image``
    for another form, type or bad base64, 400 ``image_too_large`` past ``max_bytes`` (told
    from the base64's length, before decoding it)."""
    where = f"'{param}[{index}]'"
    header, comma, data = uri.partition(",")
    if not comma:
        raise _invalid(f"{where} is not a data URI: no ',' after its header", param)
    mime, *parameters = header[len("data:") :].split(";")
    subtype = mime.lower().removeprefix("image/")
    if subtype not in IMAGE_TYPES:
        raise _invalid(f"{where} is an image of type {mime!r}; send {ACCEPTED_TYPES}", param)
    if not parameters or parameters[-1].lower() != "base64":
        raise _invalid(
            f"{where} is not base64: only base64 data URIs are accepted (data:{mime};base64,...)",
            param,
        )
    padding = 2 if data.endswith("==") else 1 if data.endswith("=") else 0
    size = len(data) // 4 * 3 - padding  # what valid base64 of this length decodes to
    if size > max_bytes:
        raise APIError(
            400,
            f"{where} is an image of {size:,} bytes, over the {max_bytes:,} limit "
            "(EMBEDFLEET_MAX_IMAGE_BYTES); send it smaller (embedding models see a few hundred "
            "pixels a side)",
            param=param,
            code="image_too_large",
        )
    try:
        image = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as error:  # ValueError: a character outside ASCII
        raise _invalid(f"{where} is not valid base64 ({error})", param) from None
    if not image:
        raise _invalid(f"{where} holds no image: its data is empty", param)
    return image


def _invalid(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_image")


def refuse_unserved(image: bool, modalities: Sequence[str], param: str, index: int) -> None:
    """The options verifier's modality rule for an input (``check_modality``), as a 400
    ``modality_not_served`` that names the input."""
    what = "an image (a data URI)" if image else "text"
    try:
        check_modality(image, modalities, where=f"'{param}[{index}]' is {what}, and ")
    except ModalityError as error:
        raise APIError(400, str(error), param=param, code="modality_not_served") from None


def take_images(
    items: Sequence[str], modalities: Sequence[str] | None, max_bytes: int, param: str = "input"
) -> list[Input]:
    """``items`` in order, each image data URI decoded to its bytes (``decode_data_uri``);
    each held against ``modalities`` (the card's; None: no card yet, the worker checks)."""
    inputs: list[Input] = []
    for index, item in enumerate(items):
        image = is_image_uri(item)
        if modalities is not None:
            refuse_unserved(image, modalities, param, index)
        inputs.append(decode_data_uri(item, max_bytes, param, index) if image else item)
    return inputs


def require_image_uris(value: object, param: str = "input") -> None:
    """Infinity's images alone (/embeddings_image, or ``"modality": "image"``): ``value`` one
    image data URI or a list of them, checked by their prefix alone (``take_images`` decodes
    them); an http(s) URL refused (400 ``url_not_accepted``: nothing is fetched), and anything
    else (400 ``invalid_image``)."""
    items = value if isinstance(value, list) else [value]
    for index, item in enumerate(items):
        if not isinstance(item, str):
            raise _invalid(f"'{param}[{index}]' is not an image: send a data URI", param)
        if item[:8].lower().startswith(REMOTE_PREFIXES):
            raise APIError(
                400,
                f"'{param}[{index}]' is a URL; only data URIs are accepted "
                "(data:image/png;base64,...): this gateway fetches nothing. Read the image "
                "and send its bytes as base64.",
                param=param,
                code="url_not_accepted",
            )
        if not is_image_uri(item):
            raise _invalid(
                f"'{param}[{index}]' is not an image: send a data URI ({ACCEPTED_TYPES}, "
                "base64), e.g. data:image/png;base64,iVBORw0...",
                param,
            )


def texts_of(inputs: Sequence[Input]) -> list[str]:
    """The texts among ``inputs``, in order."""
    return [item for item in inputs if isinstance(item, str)]


def text_positions(inputs: Sequence[Input]) -> list[int]:
    """Where each text of ``texts_of(inputs)`` sits among ``inputs``: what an error about the
    n-th text names it by."""
    return [at for at, item in enumerate(inputs) if isinstance(item, str)]


def with_texts(inputs: Sequence[Input], texts: Sequence[str]) -> list[Input]:
    """``inputs`` with their texts replaced, in order, by ``texts`` (as fitted to the model)."""
    if len(texts) != len(texts_of(inputs)):
        raise ValueError(f"{len(texts)} texts for the {len(texts_of(inputs))} of the inputs")
    replacements = iter(texts)
    return [item if isinstance(item, bytes) else next(replacements) for item in inputs]
