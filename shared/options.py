"""The options verifier: a request's options held against the model, each rule raised here.

The protocol (shared/protocol.py) checks an option's *form* (``dimensions`` an integer from 0
to 65,536, ``prompt_name`` a short string); whether the served model can honour it is decided
here, once, against its model card (shared/modelcard.py) or, in the worker, against the same
facts of the loaded model: a dimension it has, a prompt it declares, a representation it gives,
an input within its tokens, token ids of its tokenizer. Every door calls this module (the
``Producer`` and ``embedfleet enqueue`` through ``verify``, the gateway's dialects through
gateway/inputs.py, the Batch API's lines) and so does the worker (workers/output.py); a door
maps the error to its dialect (an HTTP status, OpenAI's error shape, a gRPC status) and never
checks again. As vLLM's ``PoolingParams.verify(model_config)`` and TEI's core validation.

Each rule has its own error type, a subclass of ``OptionError``, itself the protocol's
``ProtocolError`` (a ``ValueError``): whatever caught those still catches these, and a worker
dead-letters them under ``options`` (``tokenizer`` for foreign token ids).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from embedfleet.shared.dead_letters import DeadReason
from embedfleet.shared.protocol import FULL_DIMENSIONS, LONG_INPUT_OPTION, Chunk, ProtocolError
from embedfleet.shared.tokens import foreign_ids_message, split_fingerprint


class OptionError(ProtocolError):
    """An option the served model cannot honour; the message says which and what to use."""

    def __init__(self, message: str, code: DeadReason = DeadReason.OPTIONS) -> None:
        super().__init__(message, code)


class DimensionsError(OptionError):
    """``dimensions`` (or EMBEDFLEET_DIMENSIONS) more than the model's vector has."""


class PromptError(OptionError):
    """A prompt name (or EMBEDFLEET_*_PROMPT_NAME) the model does not declare."""


class RepresentationError(OptionError):
    """A representation, or an option of one, the model does not give."""


class TokenLimitError(OptionError):
    """An input over the model's maximum tokens: ``index`` (the first of the longest),
    ``tokens`` (its length) and ``limit``, for each dialect to say in its own words."""

    def __init__(self, message: str, *, index: int = 0, tokens: int = 0, limit: int = 0) -> None:
        super().__init__(message, DeadReason.TOO_LONG)
        self.index, self.tokens, self.limit = index, tokens, limit


class ForeignTokenIdsError(OptionError):
    """Token ids made by another tokenizer than the model's."""

    def __init__(self, message: str) -> None:
        super().__init__(message, DeadReason.TOKENIZER)


class ModalityError(OptionError):
    """An image for a model that embeds text only, or a text for one that embeds images only."""


class ModelFacts(Protocol):
    """What the verifier reads of a model card (shared/modelcard.py ``ModelCard``)."""

    @property
    def name(self) -> str: ...
    @property
    def dim(self) -> int: ...
    @property
    def representations(self) -> tuple[str, ...]: ...
    @property
    def named_prompts(self) -> dict[str, str]: ...
    @property
    def tokenizer_fingerprint(self) -> str: ...
    @property
    def modalities(self) -> tuple[str, ...]: ...


# --- dimensions -------------------------------------------------------------------------
def check_dimensions(dimensions: int, card: ModelFacts, *, where: str = "") -> None:
    """DimensionsError for ``dimensions`` (as the protocol shapes it: shared/protocol.py
    ``check_dimensions``) more than the model has; ``FULL_DIMENSIONS`` is its whole vector.
    The one message for it, whichever door asked (the producer, the gateway)."""
    if dimensions > card.dim:
        raise DimensionsError(
            f"{where}dimensions={dimensions} is more than the model {card.name!r} has "
            f"({card.dim}); use 1..{card.dim}"
        )


def resolve_dimensions(requested: int | None, default: int, model_dim: int) -> int:
    """The dimension one chunk gets in the worker: its own (``FULL_DIMENSIONS``: the model's
    whole vector, whatever the setting says), else the setting (0 = full), checked."""
    if requested == FULL_DIMENSIONS:
        return model_dim
    dim = requested if requested is not None else (default or model_dim)
    if not 1 <= dim <= model_dim:
        raise DimensionsError(
            f"dimensions={dim} is out of range for this model: use 1..{model_dim}"
        )
    return dim


def check_dimensions_setting(dimensions: int, model_dim: int) -> None:
    """DimensionsError, at a worker's start, for EMBEDFLEET_DIMENSIONS over the model's."""
    if dimensions > model_dim:
        raise DimensionsError(
            f"EMBEDFLEET_DIMENSIONS={dimensions} is more than the model's "
            f"{model_dim} dimensions; use 1..{model_dim} or 0 for all"
        )


# --- prompts ----------------------------------------------------------------------------
def prompt_text(prompts: Mapping[str, str], name: str, *, where: str = "") -> str:
    """The text of the prompt ``name`` among a card's ``named_prompts`` (``query`` and
    ``document`` always there); PromptError naming the known ones."""
    if name not in prompts:
        known = ", ".join(sorted(prompts))
        raise PromptError(
            f"{where}prompt_name={name!r} is not one of the model's prompts ({known}); "
            "pass a literal 'prompt' instead"
        )
    return prompts[name]


def resolve_prompt(
    prompts: Mapping[str, str],
    default_prompt_name: str | None,
    role: str,
    prompt_name: str | None,
    prompt: str | None,
    role_default: str,
) -> str:
    """The prompt text for one chunk, as sentence-transformers chooses it: a literal ``prompt``
    wins over any name; else ``prompt_name``, else the prompt role's default (``role_default``:
    the EMBEDFLEET_*_PROMPT_NAME setting, else the role's own name among the model's
    ``prompts``, else ``default_prompt_name``). ``prompts`` holds ``query`` and ``document``
    (empty) unless the model sets them, which is why encode_query / encode_document never fall
    back to the default prompt name. PromptError for a name the model does not declare. The one
    rule the worker's tokenizer and a producer that makes token ids (producer/token_ids.py)
    share."""
    if prompt is not None:
        return prompt
    if prompt_name is None:
        prompt_name = role_default or _role_prompt_name(prompts, default_prompt_name, role)
    if prompt_name is None:
        return ""
    if prompt_name not in prompts:
        raise PromptError(
            f"prompt_name {prompt_name!r} is not one of the model's prompts "
            f"({', '.join(sorted(prompts))})"
        )
    return prompts[prompt_name]


def _role_prompt_name(
    prompts: Mapping[str, str], default_prompt_name: str | None, role: str
) -> str | None:
    candidates = ("query",) if role == "query" else ("document", "passage", "corpus")
    for name in candidates:
        if name in prompts:
            return name
    return default_prompt_name


def check_prompt_setting(role: str, name: str, prompts: Mapping[str, str]) -> None:
    """PromptError, at a worker's start, for EMBEDFLEET_<ROLE>_PROMPT_NAME the model lacks."""
    if name and name not in prompts:
        raise PromptError(
            f"EMBEDFLEET_{role.upper()}_PROMPT_NAME={name!r} is not one of the model's "
            f"prompts ({', '.join(sorted(prompts))})"
        )


# --- representations -------------------------------------------------------------------
def require_representation(card: ModelFacts, wanted: str, *, where: str = "") -> None:
    """RepresentationError unless the model gives ``wanted`` (a route's or a chunk's)."""
    _require(card.name, card.representations, wanted, where)


def _require(model: str, offered: Sequence[str], wanted: str, where: str = "") -> None:
    if wanted not in offered:
        raise RepresentationError(
            f"{where}the model {model!r} serves {', '.join(offered)}, not {wanted}"
        )


def check_representation(chunk: Chunk, model: str, offered: Sequence[str]) -> None:
    """RepresentationError (dead-lettered as options) for a chunk that asks what the model does
    not give: another representation, a pair for a model that embeds, or dense-only options on
    a sparse or rerank model. A cross-encoder's chunk without a pair is its text classified
    alone (one sequence, TEI's single-text /predict). The worker's whole check, with the
    loaded model's name and representations (the first is what it serves)."""
    served = offered[0] if offered else "dense"
    for wanted in chunk.wanted_representations:
        _require(model, offered, wanted)
    if served != "dense" and (chunk.dimensions is not None or chunk.dtype is not None):
        raise RepresentationError(
            f"'dimensions' and 'dtype' shape dense vectors; this model gives {served}"
        )
    if chunk.max_active_dims is not None and "sparse" not in offered:
        raise RepresentationError("'max_active_dims' prunes sparse weights; none here")
    if chunk.raw_scores is not None and "rerank" not in offered:
        raise RepresentationError("'raw_scores' answers a cross-encoder's logits; none here")
    if chunk.multivector_dtype is not None and "multivector" not in offered:
        raise RepresentationError("'multivector_dtype' shapes per-token vectors; none here")
    if chunk.token_states and "dense" not in offered:
        raise RepresentationError(
            f"'token_states' answers the token states of a model with a dense pipeline; "
            f"the model {model!r} gives {served}"
        )
    if chunk.window_overlap is not None and (
        served != "dense"
        or any(wanted != "dense" for wanted in chunk.wanted_representations)
        or chunk.token_states
    ):
        # a sparse weight vector, per-token vectors or a pair's score have no mean over
        # windows that answers as the whole text's would
        raise RepresentationError(
            f"'{LONG_INPUT_OPTION}' embeds a long input whole as one dense vector; it does "
            "not apply to sparse, multivector, token-state or rerank outputs"
        )


def check_modality(image: bool, modalities: Sequence[str], *, where: str = "") -> None:
    """ModalityError for an image (``image``) or a text a model serving ``modalities`` (the
    card's: ``text``, ``image``) does not embed."""
    wanted = "image" if image else "text"
    if wanted not in modalities:
        raise ModalityError(
            f"{where}this model embeds {' and '.join(modalities)} only, not {wanted} input"
        )


def refuse_packed_token_states() -> None:
    """RepresentationError for token states asked of a worker whose bulk path packs its
    batches (the varlen layout gives pooled vectors alone): the worker's layout, not the
    model, decides this one."""
    raise RepresentationError(
        "'token_states' are computed on padded batches, and this worker's bulk path "
        "packs its batches (the varlen layout): send them on the query stream (the "
        "gateway does), or run the workers with EMBEDFLEET_LAYOUT=padded"
    )


# --- token limits -----------------------------------------------------------------------
def check_token_limit(lengths: Sequence[int], limit: int) -> None:
    """TokenLimitError for the first of the longest inputs when it is over ``limit`` tokens
    (``lengths`` counted up to at least ``limit + 1``); each dialect words it its own way."""
    longest = max(lengths, default=0)
    if longest <= limit:
        return
    index = list(lengths).index(longest)
    raise TokenLimitError(
        f"input {index} has {longest} tokens, over the model's maximum of {limit}",
        index=index,
        tokens=longest,
        limit=limit,
    )


def text_budget(limit: int, special_tokens: int, prompt_tokens: int) -> int:
    """The tokens a text may have once the special tokens and the prompt's are in;
    TokenLimitError when the prompt leaves none."""
    budget = limit - special_tokens - prompt_tokens
    if budget < 1:
        raise TokenLimitError(f"the prompt alone fills the model's {limit} tokens", limit=limit)
    return budget


# --- a chunk at a door --------------------------------------------------------------------
def verify(chunk: Chunk, card: ModelFacts) -> None:
    """Reject the options of ``chunk`` the model of ``card`` cannot honour, before they reach a
    worker: what the Producer, ``embedfleet enqueue`` and ``ModelCard.check`` ask."""
    where = f"chunk {chunk.id!r}: "
    check_modality(chunk.is_image, card.modalities, where=where)
    for wanted in chunk.wanted_representations:
        require_representation(card, wanted, where=where)
    if chunk.token_states and "dense" not in card.representations:
        raise RepresentationError(
            f"{where}token_states are a dense pipeline's token states; the "
            f"model {card.name!r} serves {', '.join(card.representations)}"
        )
    if chunk.dimensions is not None:
        check_dimensions(chunk.dimensions, card, where=where)
    if chunk.prompt is None and chunk.prompt_name is not None:
        prompt_text(card.named_prompts, chunk.prompt_name, where=where)
    if chunk.tokenizer is not None and card.tokenizer_fingerprint:
        made_by, _ = split_fingerprint(chunk.tokenizer)
        if made_by != card.tokenizer_fingerprint:
            message = foreign_ids_message(made_by, card.tokenizer_fingerprint)
            raise ForeignTokenIdsError(f"{where}{message}")
