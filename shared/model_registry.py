"""Several models in one namespace: the registry of model lanes and the one routing rule.

Each model a namespace serves has its own streams, consumer groups, job counters, model card
and heartbeats (``Keys.for_model(lane)``: ``{ns}:m:<lane>:...``); the namespace's default model
keeps the namespace's own keys. Workers started with ``EMBEDFLEET_MODEL_LANE`` serve that lane
only. At start every worker writes its model's name into the fleet-wide hash ``{ns}:models``
(``Keys.models``: name -> the key of its model card; the default lane's worker registers too,
under its served name), so anyone can list what the namespace serves with
``redis-cli HGETALL embedfleet:models``.

``route_model`` is the rule the client (``Producer(model=...)``, ``enqueue(model=...)``), the
gateway (a request's ``model``) and the CLI (``--model``) all apply: a registered name goes to
its lane; a name of the caller's own model (its settings' served names) goes to the caller's
lane even before any worker registered it (scale from zero); anything else is
``UnknownModelError``, which names what is served. Workers never remove their entry (a lane
scaled to zero stays routable, and what is enqueued for it wakes its workers); when a model is
retired, delete its field with ``redis-cli HDEL {ns}:models <name>``.

A lane worker also publishes its tokenizer (``Keys.tokenizer``, zlib-compressed
``tokenizer.json``), so a gateway counts and checks tokens for every model without their files.
"""

from __future__ import annotations

import zlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from embedfleet.shared.keys import Keys
from embedfleet.shared.modelcard import PACKAGED_ALIASES, served_name
from embedfleet.shared.settings import Settings

HUB_PREFIX = "sentence-transformers/"


class UnknownModelError(LookupError):
    """A model name that no worker of the namespace registered and that is not the caller's
    own model. ``served`` lists the registered names."""

    def __init__(self, model: str, served: Collection[str]) -> None:
        self.model = model
        self.served = sorted(served)
        listed = ", ".join(repr(name) for name in self.served) or "none registered yet"
        super().__init__(
            f"the model {model!r} is not served in this namespace (served: {listed}); a model "
            "is listed once a worker started with EMBEDFLEET_MODEL_LANE=<name> (check: "
            "redis-cli HGETALL <namespace>:models, or GET /v1/models)"
        )


@dataclass(frozen=True)
class ModelLane:
    """One registered model: the name it is asked for and its key set."""

    name: str
    keys: Keys

    @property
    def is_default(self) -> bool:
        """Whether this is the namespace's default model (the keys without a lane)."""
        return self.keys.model_lane is None


def model_label(settings: Settings) -> str:
    """The name a worker of these settings serves under (its lane, else its model's served
    name): the ``model`` label of its metrics."""
    return settings.model_lane or served_name(settings.model)


def own_names(settings: Settings, card_name: str | None = None) -> set[str]:
    """The names that mean the caller's own model (the lane its settings name, or the
    namespace's default): what a request may call it before any worker registered it."""
    if settings.model_lane is not None:
        return {settings.model_lane}
    names = {served_name(settings.model)}
    if card_name:
        names.add(card_name)
    if settings.served_model_name:
        names.add(settings.served_model_name)
    names |= {f"{HUB_PREFIX}{name}" for name in list(names)}
    if names & set(PACKAGED_ALIASES):
        names.update(PACKAGED_ALIASES)
    return names


def _decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def registered_lanes(keys: Keys, registry: Mapping[Any, Any]) -> list[ModelLane]:
    """The registry's entries (``HGETALL {ns}:models``) as lanes, by name."""
    default_card = keys.for_model(None).model
    lanes = []
    for raw_name, raw_card in registry.items():
        name, card_key = _decode(raw_name), _decode(raw_card)
        lane_keys = keys.for_model(None) if card_key == default_card else _lane_keys(keys, name)
        if lane_keys is not None and lane_keys.model == card_key:
            lanes.append(ModelLane(name, lane_keys))
    return sorted(lanes, key=lambda lane: lane.name)


def _lane_keys(keys: Keys, name: str) -> Keys | None:
    try:
        return keys.for_model(name)
    except ValueError:  # not a lane name (a field someone wrote by hand)
        return None


def route_model(
    keys: Keys, model: str | None, registry: Mapping[Any, Any], own: Collection[str]
) -> Keys:
    """The key set a chunk, job, query or request naming ``model`` goes to.

    ``keys``: the caller's own (``settings.keys``); ``model`` None is the caller's own model;
    ``registry``: ``HGETALL {ns}:models``; ``own``: the names of the caller's own model
    (``own_names``). A registered name wins; ``sentence-transformers/<name>`` is ``<name>``;
    an unknown name raises ``UnknownModelError``."""
    if model is None:
        return keys
    lanes = {lane.name: lane for lane in registered_lanes(keys, registry)}
    for name in (model, model.removeprefix(HUB_PREFIX)):
        if name in lanes:
            return lanes[name].keys
    if model in own:
        return keys
    raise UnknownModelError(model, lanes)


async def read_registry(client: aioredis.Redis, keys: Keys) -> dict[str, str]:
    """``HGETALL {ns}:models``: registered name -> its model card's key."""
    fields = await client.hgetall(keys.models)
    return {_decode(name): _decode(card) for name, card in fields.items()}


async def resolve_model(
    client: aioredis.Redis, keys: Keys, model: str | None, own: Collection[str]
) -> Keys:
    """``route_model`` with the registry read from Redis (one HGETALL; none for ``None``)."""
    if model is None:
        return keys
    return route_model(keys, model, await read_registry(client, keys), own)


async def register_model(
    client: aioredis.Redis, keys: Keys, name: str, tokenizer_json: bytes | None
) -> None:
    """What a worker writes at start, after its model card: its tokenizer (``tokenizer.json``,
    compressed, on ``keys.tokenizer``) and its name in the registry (``keys.models``)."""
    pipe = client.pipeline(transaction=False)  # two keys in different slots on a cluster
    if tokenizer_json is not None:
        pipe.set(keys.tokenizer, zlib.compress(tokenizer_json, 6))
    pipe.hset(keys.models, name, keys.model)
    await pipe.execute()


async def read_tokenizer_json(client: aioredis.Redis, keys: Keys) -> str | None:
    """The ``tokenizer.json`` a lane's workers published, or None while none did."""
    data = await client.get(keys.tokenizer)
    if data is None:
        return None
    return zlib.decompress(data if isinstance(data, bytes) else data.encode("latin-1")).decode()
