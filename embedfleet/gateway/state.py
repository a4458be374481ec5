"""What every route shares: settings, the model card the workers publish, the tokenizer, Redis,
the embedder.

The model's facts (dimension, maximum length, normalisation, prompts) come from the card the
workers publish at start (shared/modelcard.py), never from the model's files: only a worker that
loaded the model knows them (a Dense head, concatenated pooling). The gateway enqueues without a
card (scale from zero: the request wakes the first worker), so the options it sends never need
one (``wire_options``); a route that must *describe* the model waits for a card as follows:

- ``/v1/models`` answers from the settings alone before any worker published (the served name,
  without ``dimensions`` and ``max_input_tokens``);
- ``/info`` answers 503 ``no_model_card`` with Retry-After (TEI's clients read limits from it
  and must not get made-up ones);
- an embedding request checks what it can against the card when one is known, and otherwise
  lets the worker refuse an option it cannot honour (an error reply per chunk: 400); the card
  is read again once the vectors are back (a worker answered, so it has published).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Annotated

import redis.asyncio as aioredis
from fastapi import Depends, Request

from embedfleet.gateway.auth import KeyChecker
from embedfleet.gateway.embedder import Embedder, WorkerHeartbeats
from embedfleet.gateway.errors import APIError, retry_later
from embedfleet.gateway.metrics import GatewayMetrics
from embedfleet.gateway.token_ids import IdDecoder, TiktokenIds
from embedfleet.producer.client import EmbeddingOptions, Producer
from embedfleet.producer.tokens import ModelTokenizer
from embedfleet.shared.keys import Keys
from embedfleet.shared.model_registry import (
    ModelLane,
    UnknownModelError,
    own_names,
    read_registry,
    read_tokenizer_json,
    registered_lanes,
    route_model,
)
from embedfleet.shared.modelcard import (
    PACKAGED_ALIASES,
    ModelCard,
    ModelCardError,
    read_card,
    served_name,
)
from embedfleet.shared.protocol import FULL_DIMENSIONS
from embedfleet.shared.redis_conn import redis_deadline
from embedfleet.shared.settings import Settings

# How long a card read from Redis is trusted: a restarted fleet may serve a new revision of the
# model (same namespace, new card), and a re-read is one HGETALL.
CARD_MAX_AGE_S = 5.0
# What an embeddings request may take beyond EMBEDFLEET_GATEWAY_TIMEOUT_S: its clean-up (the
# query's withdrawal, EMBEDFLEET_REDIS_CLEANUP_TIMEOUT_S) and the reads around the wait
REQUEST_MARGIN_S = 1.0
# the cap on a text's counted tokens before any card says the model's maximum
UNCAPPED_TOKENS = 1 << 16


@dataclass
class Gateway:
    settings: Settings
    tokenizer: ModelTokenizer
    client: aioredis.Redis
    producer: Producer
    fleet: WorkerHeartbeats  # informative: requests are enqueued with or without a worker
    embedder: Embedder
    keys: KeyChecker
    metrics: GatewayMetrics
    started_at: int
    # EMBEDFLEET_GATEWAY_TIKTOKEN_ENCODING's encoding, loaded at start (gateway/token_ids.py)
    tiktoken_ids: TiktokenIds | None = None
    _card: ModelCard | None = field(default=None, repr=False)
    _card_read_at: float = field(default=-CARD_MAX_AGE_S, repr=False)
    # several models in one namespace (shared/model_registry.py): the lane this view serves
    # (None: the namespace's default model, or EMBEDFLEET_MODEL_LANE's), the registry as last
    # read, and one view per other lane a request named (its producer, heartbeats, tokenizer)
    lane_name: str | None = None
    _registry: dict[str, str] = field(default_factory=dict, repr=False)
    _registry_read_at: float = field(default=-CARD_MAX_AGE_S, repr=False)
    _lanes: dict[Keys, Gateway] = field(default_factory=dict, repr=False)
    _lane_lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    def __post_init__(self) -> None:
        # the embedder counts what it sends with this view's tokenizer (TEI's timing headers)
        self.embedder.count_tokens = self.count_tokens

    @property
    def model_ids(self) -> IdDecoder | None:
        """What reads token ids on /v1 as the served model's own: its tokenizer with
        EMBEDFLEET_GATEWAY_ACCEPT_TOKEN_IDS, else None (ids refused)."""
        return self.tokenizer if self.settings.gateway_accept_token_ids else None

    @property
    def openai_ids(self) -> IdDecoder | None:
        """What reads token ids on /v1/embeddings and in Batch API lines: the tiktoken encoding
        of EMBEDFLEET_GATEWAY_TIKTOKEN_ENCODING (OpenAI's clients' ids), else ``model_ids``."""
        return self.tiktoken_ids or self.model_ids

    def count_tokens(self, texts: Sequence[str]) -> int:
        """Tokens the model reads of ``texts`` (each capped at the card's maximum length, once
        known): TEI's ``x-compute-tokens``."""
        card = self._card
        cap = card.max_length if card is not None else UNCAPPED_TOKENS
        return self.tokenizer.usage(texts, cap)

    @property
    def known_card(self) -> ModelCard | None:
        """The card as last read (None before any worker published one); sync, for code that
        cannot await. ``model_card()`` refreshes it."""
        return self._card

    async def model_card(self) -> ModelCard | None:
        """The workers' model card, re-read at most every CARD_MAX_AGE_S (at every call while
        there is none: one HGETALL); None while no worker ever started in this namespace."""
        now = time.monotonic()
        if self._card is None or now - self._card_read_at >= CARD_MAX_AGE_S:
            try:
                async with redis_deadline(
                    self.settings.gateway_redis_timeout_s, "read the model card"
                ):
                    card = await read_card(self.client, self.settings.keys)
            except ModelCardError as error:  # the message says what to do
                raise APIError(
                    503, str(error), type="server_error", code="model_card_unreadable"
                ) from None
            self._card_read_at = now
            if card is not None:
                self._card = card
        return self._card

    @contextlib.asynccontextmanager
    async def request_bound(self) -> AsyncIterator[None]:
        """An embeddings request as a whole, bounded: whatever it still waits on Redis for
        (the card, the lane's length, the answers) past EMBEDFLEET_GATEWAY_TIMEOUT_S plus
        REQUEST_MARGIN_S is cancelled and answered 503 ``queue_unavailable`` with Retry-After
        (a hung Redis), in the route's envelope."""
        async with redis_deadline(
            self.settings.gateway_timeout_s + REQUEST_MARGIN_S, "answer the embeddings request"
        ):
            yield

    async def require_card(self) -> ModelCard:
        """The card, or 503 ``no_model_card`` with Retry-After: no worker has started yet."""
        card = await self.model_card()
        if card is None:
            raise retry_later(
                503,
                "no worker has published the model's facts yet (dimension, maximum length); "
                "they come with the first worker to start: retry after the Retry-After seconds. "
                f"Check: redis-cli HGETALL {self.settings.keys.model}",
                "no_model_card",
                self.settings.gateway_retry_after_s,
            )
        return card

    @property
    def model_name(self) -> str:
        """The name the workers give the model (their card's), or, before any published, the
        same rule applied to EMBEDFLEET_MODEL (a lane's view: the lane's name)."""
        card = self._card
        if card is not None:
            return card.name
        return self.lane_name or self.settings.model_lane or served_name(self.settings.model)

    # --- several models -------------------------------------------------------------------
    async def registry(self) -> dict[str, str]:
        """The namespace's registry of models (``{ns}:models``), re-read at most every
        CARD_MAX_AGE_S."""
        now = time.monotonic()
        if now - self._registry_read_at >= CARD_MAX_AGE_S:
            async with redis_deadline(
                self.settings.gateway_redis_timeout_s, "read the registry of models"
            ):
                self._registry = await read_registry(self.client, self.settings.keys)
            self._registry_read_at = now
        return self._registry

    async def models(self) -> list[ModelLane]:
        """Every model this gateway serves: its own (the default) first, then each
        registered lane, by name."""
        own_keys = self.settings.keys
        lanes = registered_lanes(own_keys, await self.registry())
        return [
            ModelLane(self.served_name, own_keys),
            *(lane for lane in lanes if lane.keys != own_keys),
        ]

    async def for_model(self, requested: str | None, param: str = "model") -> Gateway:
        """The gateway of the model ``requested`` names: this one for its own model (or
        None), a view of another registered lane (its streams, card, heartbeats and the
        tokenizer its workers published) for another; 404 ``model_not_found``, as OpenAI
        answers, for a name that is neither (the message lists what is served)."""
        if requested is None:  # no model named: this gateway's own, without a read
            return self
        keys = await self.route(requested, param)
        if keys == self.settings.keys:
            return self
        async with self._lane_lock:
            if keys not in self._lanes:
                self._lanes[keys] = await self._lane_view(keys)
        return self._lanes[keys]

    async def route(self, requested: str | None, param: str = "model") -> Keys:
        """The key set of the model ``requested`` names (``route_model``, the rule the
        client and the CLI apply too), through EMBEDFLEET_GATEWAY_MODEL_ALIASES first; 404
        ``model_not_found`` for an unknown one."""
        if requested is None:
            return self.settings.keys
        await self.model_card()  # this model's name is its card's, once published
        try:
            return route_model(
                self.settings.keys,
                self.unaliased(requested),
                await self.registry(),
                self.accepted_names(),
            )
        except UnknownModelError as error:
            served = sorted({self.served_name, *error.served})
            raise APIError(
                404,
                f"the model {requested!r} does not exist here; this gateway serves "
                f"{', '.join(repr(name) for name in served)} (GET /v1/models)",
                param=param,
                code="model_not_found",
            ) from None

    def unaliased(self, requested: str) -> str:
        """The model a request's name stands for: EMBEDFLEET_GATEWAY_MODEL_ALIASES' target for
        an alias (``text-embedding-ada-002`` from an app written for OpenAI), else the name."""
        return self.settings.model_aliases.get(requested, requested)

    async def for_request(self, requested: str | None, param: str = "model") -> Gateway:
        """``for_model`` for an OpenAI request, whose ``model`` TEI's users leave out (TEI has
        no such field): left out, the one model the namespace serves; 400 ``model_required``,
        naming them, where it serves several."""
        if requested is not None:
            return await self.for_model(requested, param)
        await self.model_card()  # its name is the card's, once published
        served = await self.models()
        if len(served) > 1:
            raise APIError(
                400,
                f"'{param}' is required: this gateway serves several models "
                f"({', '.join(repr(lane.name) for lane in served)}; GET /v1/models)",
                param=param,
                code="model_required",
            )
        return self

    async def card_of(self, keys: Keys) -> ModelCard | None:
        """The card another lane's workers published (None: none, or unreadable)."""
        async with redis_deadline(self.settings.gateway_redis_timeout_s, "read a model card"):
            try:
                return await read_card(self.client, keys)
            except ModelCardError:
                return None

    async def _lane_view(self, keys: Keys) -> Gateway:
        """A view of this gateway on another model's lane: its own settings' keys, producer,
        heartbeats and embedder; the tokenizer its workers published (``Keys.tokenizer``)."""
        async with redis_deadline(self.settings.gateway_redis_timeout_s, "read a tokenizer"):
            text = await read_tokenizer_json(self.client, keys)
        if text is None:
            raise retry_later(
                503,
                f"the workers of the model {keys.model_lane!r} have not published its "
                f"tokenizer yet; retry after the Retry-After seconds. Check: redis-cli EXISTS "
                f"{keys.tokenizer}",
                "no_model_card",
                self.settings.gateway_retry_after_s,
            )
        settings = self.settings.model_copy(
            update={"model_lane": keys.model_lane, "served_model_name": None}
        )
        producer = Producer(settings, self.client)
        producer.retry = self.producer.retry
        producer.keys = keys
        fleet = WorkerHeartbeats(self.client, settings)
        return dataclasses.replace(
            self,
            settings=settings,
            tokenizer=ModelTokenizer.from_json(text),
            producer=producer,
            fleet=fleet,
            embedder=Embedder(settings, producer, fleet, self.metrics),
            _card=None,
            _card_read_at=-CARD_MAX_AGE_S,
            lane_name=keys.model_lane,
            _lanes={},
        )

    def accepted_names(self) -> set[str]:
        """The names this gateway's own model answers to (its served name, its card's, the
        Hub's ``sentence-transformers/`` form, the packaged model's aliases)."""
        if self.lane_name is not None:
            return {self.lane_name}
        return own_names(self.settings, self._card.name if self._card else None) | {
            self.served_name
        }

    @property
    def served_name(self) -> str:
        """The name this gateway answers to: EMBEDFLEET_SERVED_MODEL_NAME, else the model's."""
        return self.settings.served_model_name or self.model_name

    def check_model(self, requested: str | None, param: str = "model") -> None:
        """An unknown model name is an error (404 model_not_found, as OpenAI answers); an alias
        of EMBEDFLEET_GATEWAY_MODEL_ALIASES stands for its model."""
        name = self.model_name
        accepted = {self.served_name, name, f"sentence-transformers/{name}"}
        if name in PACKAGED_ALIASES:
            accepted.update(PACKAGED_ALIASES)
        if requested is None or self.unaliased(requested) not in accepted:
            raise APIError(
                404,
                f"the model {requested!r} does not exist here; this gateway serves "
                f"{self.served_name!r} (GET /v1/models)",
                param=param,
                code="model_not_found",
            )


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway


GatewayDep = Annotated[Gateway, Depends(gateway_of)]


def wire_options(
    prompt_name: str | None,
    dimensions: int | None,
    *,
    before_normalize: bool = False,
    window_overlap: int | None = None,
) -> EmbeddingOptions:
    """What every chunk the gateway sends asks of the worker, explicitly, so the fleet's own
    defaults (EMBEDFLEET_DIMENSIONS, EMBEDFLEET_OUTPUT_DTYPE, each lane's default prompt) never
    change an HTTP answer, and without the model card (the gateway may enqueue before any worker
    published one): the named prompt, which the worker resolves (an unknown name comes back as
    that chunk's error), else none; these dimensions, else the model's whole vector
    (FULL_DIMENSIONS); fp16 on the wire for a unit vector (the gateway answers in floats, and
    renormalises it in float32), float32 for the vector before Normalize: its values are not
    bounded by 1, and fp16's 1e-3 relative rounding would be all the answer's error."""
    return EmbeddingOptions(
        prompt_name=prompt_name,
        prompt=None if prompt_name else "",
        dimensions=dimensions or FULL_DIMENSIONS,
        dtype="float32" if before_normalize else "float16",
        # TEI's normalize=false: the vector before the model's Normalize module (the worker's)
        normalize=False if before_normalize else None,
        # a request's window_overlap: an input over the model's maximum embedded whole, in
        # token windows pooled back into one vector (the worker's, workers/long_inputs.py)
        window_overlap=window_overlap,
    )
