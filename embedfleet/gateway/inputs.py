"""Request inputs → texts the workers embed, checked against the limits; vectors → the answer.

OpenAI's ``input`` may be a string, a list of strings, one list of token ids or a list of them.
Token ids are refused unless a setting says whose they are (gateway/token_ids.py): the gateway
cannot tell which tokenizer made them (LangChain's ``OpenAIEmbeddings`` sends tiktoken ids by
default), and ids of another vocabulary decode to other text without an error. With
EMBEDFLEET_GATEWAY_ACCEPT_TOKEN_IDS they are the model's own, decoded with its tokenizer (special
tokens dropped) and the worker tokenizes the text again: for the ids this tokenizer produced from
text this gives the same ids. With EMBEDFLEET_GATEWAY_TIKTOKEN_ENCODING, /v1/embeddings reads them
as that encoding's and embeds their text.

Fitting a text to the model's maximum (``fit_to_model``) is decided here, with the model's
tokenizer, for every route that offers a choice; whether to cut when a request does not say is
each dialect's default, a setting (``tei_truncate``: TEI's ``--auto-truncate``, on;
``openai_truncate``: OpenAI's refusal, off). A text over EMBEDFLEET_GATEWAY_MAX_INPUT_CHARS is cut
to that many characters first when truncating, as TEI cuts characters before tokens
(core/src/tokenization.rs), and refused otherwise.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np

from embedfleet.gateway.errors import APIError
from embedfleet.gateway.images import Input, take_images
from embedfleet.gateway.token_ids import IdDecoder
from embedfleet.producer.tokens import ModelTokenizer
from embedfleet.shared import options
from embedfleet.shared.modelcard import ModelCard
from embedfleet.shared.options import (
    PromptError,
    RepresentationError,
    TokenLimitError,
    check_token_limit,
    text_budget,
)
from embedfleet.shared.postprocess import normalize
from embedfleet.shared.protocol import ProtocolError, check_unicode
from embedfleet.shared.protocol import check_dimensions as check_dimensions_shape
from embedfleet.shared.settings import Settings

if TYPE_CHECKING:  # state.py's Gateway is only a type here
    from embedfleet.gateway.state import Gateway

EmbeddingInput = str | list[str] | list[int] | list[list[int]]
TruncationDirection = Literal["Right", "Left", "right", "left"]

TOKEN_IDS_REFUSED = (
    "'{param}' holds token ids, and this gateway does not accept them: it cannot tell which "
    "tokenizer made them, and ids of another vocabulary would embed other text without an error. "
    "Send the text itself. LangChain's OpenAIEmbeddings sends tiktoken ids by default: create it "
    "with OpenAIEmbeddings(..., check_embedding_ctx_length=False), or start the gateway with "
    "EMBEDFLEET_GATEWAY_TIKTOKEN_ENCODING=cl100k_base (the encoding LangChain uses) to have "
    "/v1/embeddings decode them. To accept ids made with the served model's own tokenizer, start "
    "the gateway with EMBEDFLEET_GATEWAY_ACCEPT_TOKEN_IDS=true."
)


def _is_token_ids(item: object) -> bool:
    return isinstance(item, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in item
    )


def as_texts(value: EmbeddingInput, ids: IdDecoder | None, param: str = "input") -> list[str]:
    """The texts of an OpenAI ``input`` (or TEI ``inputs``), in order; token ids decoded with
    ``ids`` (whose ids a setting says they are: ``Gateway.openai_ids``, ``Gateway.model_ids``).
    400 for a bad shape, and for token ids when ``ids`` is None."""
    if isinstance(value, str):
        items: list[object] = [value]
    elif isinstance(value, list) and value and _is_token_ids(value):
        items = [value]  # one list of token ids
    else:
        items = list(value)
    if not items:
        raise APIError(400, f"'{param}' must not be empty", param=param, code="empty_input")
    texts: list[str] = []
    for index, item in enumerate(items):
        if isinstance(item, str):
            text = item
        elif _is_token_ids(item):
            if ids is None:
                raise APIError(
                    400,
                    TOKEN_IDS_REFUSED.format(param=param),
                    param=param,
                    code="token_ids_not_accepted",
                )
            assert isinstance(item, list)
            bad = [v for v in item if not 0 <= v < ids.vocab_size]
            try:
                if bad:
                    raise ValueError(bad[:5])
                text = ids.decode(item)
            except ValueError:
                raise APIError(
                    400,
                    f"'{param}[{index}]' has token ids outside the vocabulary it is read with "
                    f"(0..{ids.vocab_size - 1}): {bad[:5] or item[:5]}",
                    param=param,
                    code="invalid_input",
                ) from None
        else:
            raise APIError(
                400,
                f"'{param}[{index}]' must be a string or a list of token ids",
                param=param,
                code="invalid_input",
            )
        if not text:
            # only the empty string: TEI refuses it (400 ``Empty``) and embeds whitespace, as
            # sentence-transformers does
            raise APIError(
                400,
                f"'{param}[{index}]' is empty; every input must contain text",
                param=param,
                code="empty_input",
            )
        texts.append(text)
    return texts


def tei_truncate(requested: bool | None, settings: Settings) -> bool:
    """Whether a TEI route cuts an over-long text: the request's ``truncate``, else
    EMBEDFLEET_GATEWAY_AUTO_TRUNCATE (TEI's ``--auto-truncate``, on by default)."""
    return settings.gateway_auto_truncate if requested is None else requested


def openai_truncate(requested: bool | None, settings: Settings) -> bool:
    """Whether /v1/embeddings cuts an over-long input: the request's ``truncate`` (not OpenAI's
    field), else EMBEDFLEET_GATEWAY_OPENAI_TRUNCATE (off: OpenAI's 400)."""
    return settings.gateway_openai_truncate if requested is None else requested


def check_limits(
    texts: Sequence[str],
    settings: Settings,
    param: str = "input",
    *,
    truncate: bool = False,
    direction: TruncationDirection = "Right",
) -> list[str]:
    """Every route's texts within the request caps, and each of them text (the protocol's
    check: a lone surrogate, which JSON's ``"\\ud800"`` makes, is the caller's error).

    A text over EMBEDFLEET_GATEWAY_MAX_INPUT_CHARS is cut to that many characters when
    ``truncate`` (the end ``direction`` keeps: ``Right`` keeps the start), as TEI cuts the
    characters before the tokens; refused otherwise. Both refusals are 400 (OpenAI's status; the
    TEI routes answer them 422, ``Validation``)."""
    check_count(len(texts), settings, param)
    return [
        _fit_chars(text, index, settings, param, truncate=truncate, direction=direction)
        for index, text in enumerate(texts)
    ]


def check_count(count: int, settings: Settings, param: str = "input") -> None:
    """400 ``too_many_inputs`` for a request of more than EMBEDFLEET_GATEWAY_MAX_INPUTS."""
    if count > settings.gateway_max_inputs:
        raise APIError(
            400,
            f"{count} inputs in one request; at most {settings.gateway_max_inputs} "
            "(EMBEDFLEET_GATEWAY_MAX_INPUTS). Split the request, or use the Batch API.",
            param=param,
            code="too_many_inputs",
        )


def _fit_chars(
    text: str,
    index: int,
    settings: Settings,
    param: str,
    *,
    truncate: bool,
    direction: TruncationDirection,
) -> str:
    """One text of ``check_limits``: within EMBEDFLEET_GATEWAY_MAX_INPUT_CHARS, and text."""
    limit = settings.gateway_max_input_chars
    if len(text) > limit:
        if not truncate:
            raise APIError(
                400,
                f"'{param}[{index}]' has {len(text):,} characters; at most {limit:,} "
                "(EMBEDFLEET_GATEWAY_MAX_INPUT_CHARS) unless it is truncated. Split long "
                "documents into chunks first, or send truncate=true to have it cut.",
                param=param,
                code="input_too_long",
            )
        text = text[:limit] if direction.lower() == "right" else text[-limit:]
    try:
        check_unicode(f"{param}[{index}]", text)
    except ProtocolError as error:
        raise APIError(400, str(error), param=param, code="invalid_input") from None
    return text


def prepare(
    value: EmbeddingInput,
    ids: IdDecoder | None,
    settings: Settings,
    param: str = "input",
    *,
    truncate: bool = False,
    direction: TruncationDirection = "Right",
) -> list[str]:
    """The request's texts (``as_texts``, token ids read with ``ids``) within the caps
    (``check_limits``): over-long ones cut to the character limit when ``truncate``."""
    texts = as_texts(value, ids, param)
    return check_limits(texts, settings, param, truncate=truncate, direction=direction)


def prepare_inputs(
    value: EmbeddingInput,
    ids: IdDecoder | None,
    settings: Settings,
    modalities: Sequence[str] | None,
    param: str = "input",
    *,
    truncate: bool = False,
    direction: TruncationDirection = "Right",
) -> list[Input]:
    """``prepare`` for the routes that embed images too (/v1/embeddings, /embed,
    /embeddings_image): each image data URI decoded to its bytes, each input held against the
    card's ``modalities`` (``modalities`` None: no card yet) (gateway/images.py), the texts
    within the caps."""
    items = as_texts(value, ids, param)
    check_count(len(items), settings, param)
    inputs = take_images(items, modalities, settings.max_image_bytes, param)
    return [
        item
        if isinstance(item, bytes)
        else _fit_chars(item, index, settings, param, truncate=truncate, direction=direction)
        for index, item in enumerate(inputs)
    ]


class TEIInputs(Protocol):
    """The fields of a TEI body (``/embed``, ``/embed_sparse``, ``/embed_all``) with its inputs."""

    @property
    def inputs(self) -> EmbeddingInput: ...
    @property
    def truncate(self) -> bool | None: ...
    @property
    def truncation_direction(self) -> TruncationDirection: ...


def prepare_tei(body: TEIInputs, gateway: Gateway) -> tuple[list[str], bool]:
    """A TEI body's texts (``prepare``) and whether over-long ones are cut (``tei_truncate``),
    which the caller passes on to ``fit_to_model``.

    Token ids are read as the served model's own whatever EMBEDFLEET_GATEWAY_ACCEPT_TOKEN_IDS
    says, as TEI reads its ``inputs`` (one sequence of ids or a batch): TEI's clients send the
    model's own ids (its /tokenize's), where /v1 cannot tell whose they are. Each sequence is
    decoded to its text (special tokens dropped: the worker adds the model's own); an id outside
    the vocabulary is refused (TEI: 422 ``Validation``)."""
    truncate = tei_truncate(body.truncate, gateway.settings)
    texts = prepare(
        body.inputs,
        gateway.tokenizer,  # TEI's routes always read ids as the model's own (TEI's reading)
        gateway.settings,
        "inputs",
        truncate=truncate,
        direction=body.truncation_direction,
    )
    return texts, truncate


def check_context(
    lengths: Sequence[int],
    max_length: int,
    param: str = "input",
    positions: Sequence[int] | None = None,
) -> None:
    """OpenAI's answer to an input over the model's maximum context: 400, nothing cut, given the
    inputs' token lengths (``ModelTokenizer.lengths``, counted up to at least ``max_length``;
    ``positions``: each one's place among the request's inputs, where images sit between the
    texts: ``images.text_positions``).
    (The OpenAI route's extension ``"truncate": true``, or EMBEDFLEET_GATEWAY_OPENAI_TRUNCATE,
    skips this check: the worker then cuts each text to fit, on the right, as
    sentence-transformers does.)"""
    try:
        check_token_limit(lengths, max_length)
    except TokenLimitError as error:
        at = error.index if positions is None else positions[error.index]
        raise APIError(
            400,
            f"This model's maximum context length is {max_length} tokens, however "
            f"'{param}[{at}]' has more. Shorten it or split it into chunks, or send "
            '"truncate": true (an extension of this API; with the openai SDK, '
            'extra_body={"truncate": True}) to have every input cut to fit.',
            param=param,
            code="context_length_exceeded",
        ) from None


def request_tokens(
    texts: Sequence[str],
    tokenizer: ModelTokenizer,
    card: ModelCard,
    settings: Settings,
    *,
    whole: bool,
    refuse_long: bool,
    param: str = "input",
    positions: Sequence[int] | None = None,
) -> int:
    """An OpenAI request's tokens, as its ``usage`` counts them (each input capped at the
    model's maximum, or counted whole when it is embedded ``whole``, in windows), after OpenAI's
    two refusals: an input over the model's context (``check_context``, when ``refuse_long``;
    ``positions`` its), and the request over EMBEDFLEET_GATEWAY_MAX_REQUEST_TOKENS (OpenAI's
    300,000, all inputs together: 400 ``max_tokens_per_request``, OpenAI's message)."""
    # a token is at least a character: a text's length bounds its tokens when counted whole
    read = max(max(map(len, texts), default=1), card.max_length) if whole else card.max_length
    lengths = tokenizer.lengths(texts, read)  # one tokenizing for both
    if refuse_long:
        check_context(lengths, card.max_length, param, positions)
    tokens = sum(min(n, read) for n in lengths)  # ModelTokenizer.usage's count
    limit = settings.gateway_max_request_tokens
    if tokens > limit:
        raise APIError(
            400,
            # OpenAI's words, as its clients read them (some split a request by them)
            f"Requested {tokens} tokens, max {limit} tokens per request",
            type="max_tokens_per_request",
            code="max_tokens_per_request",
        )
    return tokens


def fit_to_model(
    texts: Sequence[str],
    tokenizer: ModelTokenizer,
    prompt: str,
    max_length: int | None,
    *,
    truncate: bool,
    direction: TruncationDirection = "Right",
    param: str = "inputs",
    positions: Sequence[int] | None = None,
) -> list[str]:
    """The texts as the model will read them, with ``prompt`` in front (the worker tokenizes
    the two together, as sentence-transformers does); ``positions``: each text's place among the
    request's inputs, where images sit between them (``images.text_positions``).

    A text over the model's maximum is refused (422, TEI's answer) unless ``truncate``. Then
    ``Right`` keeps its start: the worker's own truncation, token for token what
    sentence-transformers does, so the text goes as it is. ``Left`` keeps its end: the text is
    cut here, at the start of the first token that still fits.

    ``max_length`` None: no worker has published the model card yet. The texts go as they are
    and the worker applies its maximum: truncation on the right, or a per-input refusal with
    ``EMBEDFLEET_TRUNCATE=false``. Only ``Left`` needs the maximum here, and says so.
    """
    if max_length is None:
        return _before_any_card(texts, truncate=truncate, direction=direction)
    lengths = tokenizer.lengths([prompt + text for text in texts], max_length)
    try:
        check_token_limit(lengths, max_length)
        return list(texts)
    except TokenLimitError as error:
        if not truncate:
            at = error.index if positions is None else positions[error.index]
            raise APIError(
                422,
                f"Input validation error: `{param}` must have less than {max_length} tokens. "
                f"Given: {error.tokens} (`{param}[{at}]`). Send truncate=true to cut "
                "them to fit, or split the text into chunks.",
                param=param,
                code="input_too_long",
            ) from None
    if direction.lower() == "right":
        return list(texts)
    return _keep_ends(texts, lengths, tokenizer, prompt, max_length, param)


def _before_any_card(
    texts: Sequence[str], *, truncate: bool, direction: TruncationDirection
) -> list[str]:
    """``fit_to_model`` before any worker published the model card: the texts as they are (the
    worker applies its maximum), but ``Left`` needs the maximum here, and says so."""
    if truncate and direction.lower() == "left":
        raise APIError(
            503,
            "truncation_direction=Left needs the model's maximum length, which the workers "
            "publish when they start; no worker has started yet. Retry in a moment.",
            type="server_error",
            code="no_model_card",
        )
    return list(texts)


def _keep_ends(
    texts: Sequence[str],
    lengths: Sequence[int],
    tokenizer: ModelTokenizer,
    prompt: str,
    limit: int,
    param: str,
) -> list[str]:
    """``truncation_direction=Left``: each text over ``limit`` tokens (``lengths``) cut to its
    end that fits after the special tokens and the prompt's."""
    try:
        budget = text_budget(limit, tokenizer.special_tokens, tokenizer.prompt_tokens(prompt))
    except TokenLimitError as error:
        raise APIError(
            422,
            f"{error}; nothing of `{param}` would fit",
            param="prompt_name",
            code="input_too_long",
        ) from None
    return [
        keep_last_tokens(text, tokenizer, budget) if length > limit else text
        for text, length in zip(texts, lengths, strict=True)
    ]


def keep_last_tokens(text: str, tokenizer: ModelTokenizer, budget: int) -> str:
    """The end of ``text`` that tokenizes to at most ``budget`` tokens (no special tokens).

    The cut falls at a token's start in the text; a word cut there tokenizes from its cut (a
    continuation piece becomes a word piece), which can take more tokens, so the cut moves on a
    token at a time until the tail fits.
    """
    encoding = tokenizer.tokenizer.encode(text, add_special_tokens=False)
    starts = [start for start, _ in encoding.offsets]
    first = len(starts) - budget
    if first <= 0:
        return text
    while first < len(starts) - 1:
        tail = text[starts[first] :]
        if len(tokenizer.tokenizer.encode(tail, add_special_tokens=False).ids) <= budget:
            return tail
        first += 1
    return text[starts[-1] :]


def check_dimensions(dimensions: int | None, card: ModelCard | None) -> None:
    """``dimensions`` as the protocol shapes it (over HTTP at least 1: the whole vector is
    ``dimensions`` left out) and, with a model card, as the verifier bounds it; their message in
    a 400. ``card`` None (no worker has published one yet): the worker refuses one over the
    model's dimension, per chunk."""
    if dimensions is None:
        return
    try:
        check_dimensions_shape(dimensions, whole=False)
        if card is not None:
            options.check_dimensions(dimensions, card)
    except ProtocolError as error:  # the verifier's DimensionsError is one
        raise APIError(400, str(error), param="dimensions", code="invalid_dimensions") from None


def prompt_of(card: ModelCard, name: str | None, param: str | None = "prompt_name") -> str:
    """The text of the prompt a TEI request names (``""`` for none: TEI's meaning), the
    verifier's PromptError as TEI answers it (422)."""
    if name is None:
        return ""
    try:
        return options.prompt_text(card.named_prompts, name)
    except PromptError as error:
        raise APIError(422, str(error), param=param, code="invalid_prompt") from None


def not_served(card: ModelCard, wanted: str) -> bool:
    """Whether the model of ``card`` does not give ``wanted`` (the verifier's rule), for a
    route to answer in its dialect's words."""
    try:
        options.require_representation(card, wanted)
    except RepresentationError:
        return True
    return False


def unit_vectors(vectors: np.ndarray, unit: bool) -> np.ndarray:
    """The answer's vectors in float32: unit length when ``unit`` (the model normalises, or TEI's
    ``normalize``), normalised once here, in float32, so what crossed the wire as fp16 (and was
    truncated and renormalised by the worker) leaves at norm 1."""
    return normalize(vectors) if unit else np.asarray(vectors, dtype=np.float32)


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """``float``: a JSON list; ``base64``: little-endian float32 bytes, as OpenAI sends."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return [float(v) for v in np.asarray(vector, dtype=np.float32)]
