"""One model's lane of a namespace: what every part of the producer reads of the producer.

A ``Producer`` (producer/client.py) is a ``ProducerLane`` (its settings, connection, retry,
keys, tenant and model card, routed to its model at ``setup()``) and a facade over parts that
each do one thing (enqueueing, backlog waits, queries, jobs, results, documents). The parts
read the lane's connection, retry and keys through it at each call rather than keeping copies:
a lane's keys are routed at ``setup()``, and ``for_model`` and the gateway hand a lane another
producer's retry and keys after it is built.
"""

from __future__ import annotations

import time
from typing import Self

import redis.asyncio as aioredis

from embedfleet.producer.token_ids import TokenIdMaker, TokenIdsUnavailableError
from embedfleet.shared.keys import Keys
from embedfleet.shared.model_registry import own_names, read_tokenizer_json, resolve_model
from embedfleet.shared.modelcard import ModelCard, read_card
from embedfleet.shared.options import verify
from embedfleet.shared.protocol import Chunk
from embedfleet.shared.redis_conn import connect_client_settings, ensure_groups, redact_url
from embedfleet.shared.retry import LogOutages, OutageListener, RedisRetry
from embedfleet.shared.settings import Settings

# How often a client without the model card asks Redis for it again (no worker has started yet)
CARD_RECHECK_S = 1.0


class ProducerLane:
    """The connection, retry, keys, tenant and model card of one producer."""

    def __init__(
        self,
        settings: Settings | None = None,
        client: aioredis.Redis | None = None,
        *,
        on_outage: OutageListener | None = None,
        first_contact_s: float | None = None,
        model: str | None = None,
        tenant: str | None = None,
    ):
        """``on_outage`` is told once when Redis becomes unreachable and once when it is back
        (default: a log line each); every call waits for it, for at most
        ``EMBEDFLEET_REDIS_RETRY_S``, then raises ``RedisUnavailableError``. With
        ``first_contact_s``, a Redis this client has not reached yet is given up on after that
        long instead (the CLI verbs: a server that was never up is not an outage).

        ``model``: the model this producer's chunks, jobs and queries go to in a namespace
        serving several (shared/model_registry.py), routed at ``setup()`` (``async with``); a
        name no worker registered raises ``UnknownModelError`` there. None: the settings' own
        (``EMBEDFLEET_MODEL_LANE``, else the namespace's default model). Single calls can name
        another: ``enqueue(..., model=...)``, ``embed_queries(..., model=...)``.

        ``tenant``: the tenant this producer's chunks are accounted to and share the fleet as
        (shared/tenants.py), unless a call or a chunk names another; None: what
        EMBEDFLEET_TENANT_MAP says for each chunk's job, else EMBEDFLEET_DEFAULT_TENANT."""
        self.settings = settings or Settings()
        self.tenants = self.settings.tenant_policy
        self.tenant = None if tenant is None else self.tenants.resolve(tenant)
        self.keys: Keys = self.settings.keys
        self.model = model
        self._routed = model is None
        self.client = client or connect_client_settings(self.settings)
        self._owns_client = client is None
        self._ready = False
        self.retry = RedisRetry(
            redact_url(self.settings.effective_redis_url),
            self.settings.redis_retry_s,
            on_outage or LogOutages(),
            first_contact_s,
        )
        self._card: ModelCard | None = None
        self._card_missing_at = float("-inf")
        self._token_ids: TokenIdMaker | None = None

    async def __aenter__(self) -> Self:
        await self.setup()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def setup(self, *, deadline: float | None = None) -> None:
        """Route to this producer's model (``model=``), then create the consumer groups if no
        worker has yet (at id 0: nothing is skipped)."""
        if not self._routed:
            self.keys = await self.route(self.model, deadline=deadline)
            self._routed = True
        if not self._ready:
            await self.retry.call(
                "create the consumer groups",
                lambda: ensure_groups(self.client, self.keys),
                deadline=deadline,
            )
            self._ready = True

    async def routed(self, *, deadline: float | None = None) -> None:
        """Before a read: routed to this producer's model (``setup``) unless it is already."""
        if not self._routed:
            await self.setup(deadline=deadline)

    async def close(self) -> None:
        if self._owns_client:
            await self.client.aclose()

    async def route(self, model: str | None, *, deadline: float | None = None) -> Keys:
        """The key set of ``model`` in this namespace: the one rule the producer, the gateway
        and the CLI share (``shared/model_registry.route_model``: a registered name, or this
        producer's own model; ``UnknownModelError`` for any other). None: this producer's."""
        if model is None:
            return self.keys
        own = own_names(self.settings, None if self._card is None else self._card.name)
        base = self.settings.keys
        return await self.retry.call(
            "read the registry of models",
            lambda: resolve_model(self.client, base, model, own),
            deadline=deadline,
        )

    async def model_card(self, *, deadline: float | None = None) -> ModelCard | None:
        """The facts the workers published about their model (``Keys.model``,
        shared/modelcard.py), or None while no worker ever started in this namespace. Read once,
        then kept (a producer's keys are one model's); while there is none, asked again at most
        every CARD_RECHECK_S, so enqueueing before any worker started is not one read per chunk."""
        now = time.monotonic()
        if self._card is None and now - self._card_missing_at >= CARD_RECHECK_S:
            self._card = await self.retry.call(
                "read the model card",
                lambda: read_card(self.client, self.keys),
                deadline=deadline,
            )
            self._card_missing_at = now
        return self._card

    async def token_id_maker(self, *, deadline: float | None = None) -> TokenIdMaker:
        """What makes this lane's chunks' token ids (producer/token_ids.py), from the model card
        and the tokenizer the workers published; kept. TokenIdsUnavailableError says why not."""
        if self._token_ids is None:
            card = await self.model_card(deadline=deadline)
            tokenizer = await self.retry.call(
                "read the published tokenizer",
                lambda: read_tokenizer_json(self.client, self.keys),
                deadline=deadline,
            )
            if card is None or tokenizer is None:
                raise TokenIdsUnavailableError(
                    "token ids need the tokenizer a worker publishes at start, and no worker "
                    f"has started for {self.keys.model!r} yet: start one, or enqueue without "
                    "token ids (EMBEDFLEET_PRODUCER_TOKEN_IDS=false)"
                )
            try:
                import tokenizers  # noqa: F401 - the [documents] extra
            except ImportError as error:
                raise TokenIdsUnavailableError(
                    "token ids need the tokenizers package: pip install 'embedfleet[documents]'"
                ) from error
            self._token_ids = TokenIdMaker(
                card,
                tokenizer,
                {
                    "query": self.settings.query_prompt_name,
                    "document": self.settings.document_prompt_name,
                },
            )
        return self._token_ids

    async def checked(self, chunk: Chunk, *, deadline: float | None = None) -> Chunk:
        """``chunk``, once the served model (its card, where a worker published one) can honour
        its options; the options verifier's error (shared/options.py) saying why not otherwise."""
        card = await self.model_card(deadline=deadline)
        if card is not None:
            verify(chunk, card)
        return chunk
