"""Images among a request's inputs (embedfleet/gateway/images.py): a base64 data URI made into
its bytes, each refusal a 400 that says why, the options verifier's modality rule by input, and
the texts taken out and put back in their places."""

from __future__ import annotations

import base64

import pytest

from embedfleet.gateway.errors import APIError, ErrorDialect
from embedfleet.gateway.images import (
    decode_data_uri,
    is_image_uri,
    require_image_uris,
    take_images,
    text_positions,
    texts_of,
    with_texts,
)
from embedfleet.gateway.inputs import prepare_inputs
from embedfleet.shared.settings import Settings

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 3  # the form is checked here, not the pixels
DUAL = ("text", "image")


def uri(data: bytes = PNG, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def refused(call, *args, **kwargs) -> APIError:  # type: ignore[no-untyped-def]
    with pytest.raises(APIError) as caught:
        call(*args, **kwargs)
    assert caught.value.status == 400
    return caught.value


def test_a_data_uri_decodes_to_its_bytes() -> None:
    assert decode_data_uri(uri(), 10_000) == PNG
    for mime in ("image/jpeg", "image/jpg", "image/webp", "image/gif", "IMAGE/PNG"):
        assert decode_data_uri(uri(mime=mime), 10_000) == PNG
    # parameters before ;base64 (a name, as some encoders write), the scheme in any case
    named = "data:image/png;name=cat.png;base64," + base64.b64encode(PNG).decode()
    assert decode_data_uri(named, 10_000) == PNG
    assert is_image_uri("DATA:Image/png;base64,AAAA") and is_image_uri(uri())
    assert not is_image_uri("data:text/plain;base64,AAAA")
    assert not is_image_uri("a picture: data:image/png;base64,AAAA")


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("data:image/png;base64", "no ','"),
        ("data:image/tiff;base64,AAAA", "type 'image/tiff'; send image/png"),
        ("data:image/svg+xml;base64,AAAA", "type 'image/svg+xml'"),
        ("data:image/png,%89PNG", "only base64 data URIs are accepted"),
        ("data:image/png;base64,not base64!", "is not valid base64"),
        ("data:image/png;base64,AAA", "is not valid base64"),  # not a multiple of 4
        ("data:image/png;base64,iVBO\nRw==", "is not valid base64"),  # no line breaks
        ("data:image/png;base64,iVBÖRw==", "is not valid base64"),
        ("data:image/png;base64,", "its data is empty"),
    ],
)
def test_a_malformed_data_uri_is_a_400_saying_why(value: str, words: str) -> None:
    error = refused(decode_data_uri, value, 10_000, "inputs", 3)
    assert error.code == "invalid_image" and error.param == "inputs"
    assert error.message.startswith("'inputs[3]'") and words in error.message
    # TEI's routes answer it 422 (Validation), OpenAI's 400
    assert ErrorDialect.tei.status(error) == 422 and ErrorDialect.openai.status(error) == 400


def test_an_image_over_the_cap_is_refused_before_it_is_decoded() -> None:
    assert decode_data_uri(uri(PNG), len(PNG)) == PNG  # at the cap: taken
    for data in (PNG + b"x", PNG + b"xy", PNG + b"xyz"):  # each padding: one byte over, or more
        error = refused(decode_data_uri, uri(data), len(PNG))
        assert error.code == "image_too_large" and "EMBEDFLEET_MAX_IMAGE_BYTES" in error.message
        assert f"{len(data):,} bytes" in error.message
    # from the length alone: what would not even decode is refused as too large first
    huge = "data:image/png;base64," + "!" * 4_000_000
    assert refused(decode_data_uri, huge, 1_000_000).code == "image_too_large"


def test_images_are_taken_by_the_lanes_modalities() -> None:
    items = ["a red bicycle", uri(), "https://example.com/cat.png"]
    assert take_images(items, DUAL, 10_000) == ["a red bicycle", PNG, items[2]]
    assert take_images(items, None, 10_000) == ["a red bicycle", PNG, items[2]]  # no card yet
    # a text-only lane: the image is refused with the verifier's words, never embedded as text
    error = refused(take_images, items, ("text",), 10_000)
    assert error.code == "modality_not_served" and error.param == "input"
    assert error.message == (
        "'input[1]' is an image (a data URI), and this model embeds text only, not image input"
    )
    assert take_images(items[::2], ("text",), 10_000) == items[::2]
    # an image-only lane refuses a text the same way
    assert "embeds image only, not text input" in refused(take_images, items, ("image",), 1).message


def test_embeddings_image_takes_data_uris_alone() -> None:
    require_image_uris([uri(), uri(mime="image/gif")])
    for url in ("https://example.com/cat.png", "HTTP://example.com/cat.png"):
        error = refused(require_image_uris, [uri(), url])
        assert error.code == "url_not_accepted" and error.message.startswith("'input[1]' is a URL")
        assert "only data URIs are accepted" in error.message
    error = refused(require_image_uris, ["a red bicycle"])
    assert error.code == "invalid_image" and "is not an image" in error.message
    require_image_uris(uri())  # one image alone, as a string
    assert refused(require_image_uris, [[1, 2, 3]]).code == "invalid_image"  # token ids


def test_texts_come_out_and_go_back_in_their_places() -> None:
    inputs = ["a", PNG, "b", b"GIF89a"]
    assert texts_of(inputs) == ["a", "b"] and text_positions(inputs) == [0, 2]
    assert with_texts(inputs, ["A", "B"]) == ["A", PNG, "B", b"GIF89a"]
    with pytest.raises(ValueError, match="1 texts for the 2"):
        with_texts(inputs, ["A"])


def test_prepare_inputs_holds_texts_to_the_caps_and_images_to_theirs() -> None:
    settings = Settings(gateway_max_inputs=3, gateway_max_input_chars=10, max_image_bytes=10_000)
    assert prepare_inputs(["hello", uri()], None, settings, DUAL) == ["hello", PNG]
    # a data URI is no text: the character cap is not its (it is thousands of characters)
    assert len(uri()) > 10
    error = refused(prepare_inputs, [uri(), "x" * 11], None, settings, DUAL)
    assert error.code == "input_too_long" and error.message.startswith("'input[1]'")
    assert prepare_inputs([uri(), "x" * 11], None, settings, DUAL, truncate=True)[1] == "x" * 10
    # every input counts towards the request's cap, images too
    error = refused(prepare_inputs, [uri()] * 4, None, settings, DUAL)
    assert error.code == "too_many_inputs"
    small = settings.model_copy(update={"max_image_bytes": 100})
    assert refused(prepare_inputs, [uri()], None, small, DUAL).code == "image_too_large"
