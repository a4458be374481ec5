"""The model facts the workers publish: the one source the gateway and the client read.

A worker knows what it serves only once it has loaded the model (a Dense head changes the
output dimension, concatenated pooling multiplies it, a plain Hugging Face directory is not
normalised): it writes a :class:`ModelCard` to ``Keys.model`` at start (:func:`publish_card`),
and the gateway and ``Producer`` read it from there (:func:`read_card`); nobody re-derives these
facts from the model's files. The two rules a caller must apply before any worker ran (the name
the fleet serves, the longest input) are here too, so the worker and everyone else use the same.
Whether a request's options fit the card is the options verifier's (shared/options.py).

On Redis the card is a plain hash, readable with ``redis-cli HGETALL {ns}:model``: numbers and
names as strings, ``prompts`` and ``pooling`` as JSON. A card is one model's: the namespace's
default model has ``{ns}:model``, each further model its lane's (``{ns}:m:<lane>:model``,
shared/model_registry.py); the last worker of that model to start writes it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from embedfleet.shared import options
from embedfleet.shared.content_key import VectorRecipe
from embedfleet.shared.keys import Keys
from embedfleet.shared.options import resolve_prompt as resolve_prompt
from embedfleet.shared.protocol import Chunk
from embedfleet.shared.settings import PACKAGED_MODEL

# The card's layout version (the ``version`` field); a reader refuses a newer one it cannot read.
CARD_VERSION = 1
# Names under which the packaged model is also asked for (the Hub id people know it by)
PACKAGED_ALIASES = (PACKAGED_MODEL, f"sentence-transformers/{PACKAGED_MODEL}")
# Where neither the tokenizer nor the model declares a length (sentence-transformers' fallback)
FALLBACK_MAX_LENGTH = 512


class ModelCardError(ValueError):
    """A card on Redis that cannot be read; the message says which field and what to do."""


def served_name(model: str) -> str:
    """The name results carry and the gateway serves by default, from ``EMBEDFLEET_MODEL``: the
    packaged model's name, else the model directory's folder name."""
    if model in PACKAGED_ALIASES:
        return PACKAGED_MODEL
    return Path(model).expanduser().name


def max_input_tokens(
    declared: int | None, tokenizer_max: int | None, position_limit: int | None
) -> int:
    """The longest input in tokens, as sentence-transformers decides it: the directory's
    ``max_seq_length`` when declared, else the tokenizer's ``model_max_length`` capped at the
    model's ``max_position_embeddings``."""
    if declared is not None and declared > 0:
        return declared
    return min(tokenizer_max or FALLBACK_MAX_LENGTH, position_limit or FALLBACK_MAX_LENGTH)


@dataclass(frozen=True)
class ModelCard:
    """What the workers of a namespace serve, as they computed it from the loaded model."""

    name: str
    """The served name: what results carry in ``model`` and the gateway answers to."""
    dim: int
    """Output dimension of a vector, after Dense heads and concatenated pooling."""
    max_length: int
    """Longest input in tokens (special and prompt tokens included); longer ones are cut."""
    normalize: bool
    """Whether vectors come out unit length (the pipeline ends in a Normalize module); a plain
    Hugging Face directory is not normalised, as in sentence-transformers."""
    prompts: dict[str, str] = field(default_factory=dict)
    """The model's own prompts (``config_sentence_transformers.json``), name to text."""
    default_prompt_name: str | None = None
    """The prompt ``SentenceTransformer.encode`` applies when none is named."""
    hidden_size: int = 0
    """Width of the transformer's token embeddings (before pooling and Dense heads)."""
    pooling: tuple[str, ...] = ("mean",)
    """Pooling modes, concatenated in this order."""
    include_prompt: bool = True
    """Whether the prompt's tokens are pooled with the text's."""
    architecture: str = ""
    """``config.json``'s first architecture, e.g. ``BertModel``."""
    representations: tuple[str, ...] = ("dense",)
    """What the model gives (shared/protocol.py ``REPRESENTATIONS``): ``dense`` vectors
    (SentenceTransformer), ``sparse`` weights (SparseEncoder, SPLADE; ``dim`` is then the
    vocabulary size) or ``rerank`` scores of (query, document) pairs (CrossEncoder; ``dim`` is
    its number of labels). A card written before this field existed serves ``dense``."""
    revision: str = ""
    """Which version of the model's weights and files this is: ``EMBEDFLEET_MODEL_REVISION``,
    else a Hugging Face snapshot's commit (``hf:<sha>``) or a digest of the directory's files
    (``blake2b:<hex>``). Part of every chunk's content key (shared/content_key.py), so vectors
    of another revision are never reused. Empty on a card written before it existed."""
    dtype: str = ""
    """The precision the worker computes in, settled at load (``float32``, ``bfloat16``,
    ``float16``: EMBEDFLEET_DTYPE, ``auto`` after its parity probe); TEI's /info reports it as
    ``model_dtype``. Empty on a card written before it existed."""
    tokenizer_fingerprint: str = ""
    """The fingerprint of the tokenizer the workers publish (``Keys.tokenizer``, shared/tokens.py
    ``tokenizer_fingerprint``): token ids a producer sends must carry it (the chunk's
    ``tokenizer``). Empty on a card written before it existed: producers then send no ids."""
    modalities: tuple[str, ...] = ("text",)
    """What the lane embeds: ``text``, and ``image`` for a dual encoder (CLIP, SigLIP:
    workers/model/clip.py). A chunk of another modality is dead-lettered (``options``). A card
    written before this field existed serves ``text``."""

    def recipe(
        self,
        *,
        prompt: str,
        dimensions: int,
        renormalize: bool,
        dtype: str,
        max_active_dims: int | None = None,
    ) -> VectorRecipe:
        """The content key's recipe for one chunk of this model, its options resolved as the
        worker resolves them (the prompt's text, the dimension after EMBEDFLEET_DIMENSIONS)."""
        return VectorRecipe(
            model=self.name,
            revision=self.revision,
            representation=self.representations[0] if self.representations else "dense",
            pooling=tuple(self.pooling),
            include_prompt=self.include_prompt,
            normalize=self.normalize,
            max_length=self.max_length,
            prompt=prompt,
            dimensions=dimensions,
            renormalize=renormalize,
            dtype=dtype,
            max_active_dims=max_active_dims,
        )

    def serves(self, representation: str) -> bool:
        return representation in self.representations

    def check(self, chunk: Chunk) -> None:
        """Reject options this model cannot honour, before they reach a worker: the options
        verifier's ``verify`` (shared/options.py), an ``OptionError`` (a ValueError)."""
        options.verify(chunk, self)

    def check_dimensions(self, dimensions: int, *, where: str = "") -> None:
        """``DimensionsError`` for ``dimensions`` more than the model has (shared/options.py
        ``check_dimensions``)."""
        options.check_dimensions(dimensions, self, where=where)

    @property
    def named_prompts(self) -> dict[str, str]:
        """Every prompt name a request may use, to its text: the model's own, and ``query`` and
        ``document`` (empty), which sentence-transformers declares for every model."""
        return {"query": "", "document": "", **self.prompts}

    def prompt_text(self, name: str, *, where: str = "") -> str:
        """The text of the model's prompt ``name``; ``PromptError`` naming the known ones
        (shared/options.py ``prompt_text``). sentence-transformers declares ``query`` and
        ``document`` (empty) for every model, so those names are always accepted, as the worker
        accepts them."""
        return options.prompt_text(self.named_prompts, name, where=where)

    def to_fields(self) -> dict[str, str]:
        """The hash fields :func:`publish_card` writes (strings, JSON for the structured ones)."""
        return {
            "version": str(CARD_VERSION),
            "name": self.name,
            "dim": str(self.dim),
            "max_length": str(self.max_length),
            "normalize": str(int(self.normalize)),
            "prompts": json.dumps(self.prompts, sort_keys=True),
            "default_prompt_name": self.default_prompt_name or "",
            "hidden_size": str(self.hidden_size),
            "pooling": json.dumps(list(self.pooling)),
            "include_prompt": str(int(self.include_prompt)),
            "architecture": self.architecture,
            "representations": json.dumps(list(self.representations)),
            "revision": self.revision,
            "dtype": self.dtype,
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "modalities": json.dumps(list(self.modalities)),
        }

    @classmethod
    def from_fields(cls, fields: Mapping[Any, Any]) -> ModelCard:
        """A card from its hash (bytes or str keys and values, as redis-py returns them)."""
        values = {_text(key): _text(value) for key, value in fields.items()}
        try:
            version = int(values.get("version", "1"))
            if version > CARD_VERSION:
                raise ModelCardError(
                    f"the model card was written by a newer worker (layout {version}, this "
                    f"reads {CARD_VERSION}); upgrade embedfleet here to the workers' version"
                )
            prompts = json.loads(values.get("prompts") or "{}")
            return cls(
                name=values["name"],
                dim=int(values["dim"]),
                max_length=int(values["max_length"]),
                normalize=values["normalize"] == "1",
                prompts={str(k): str(v) for k, v in prompts.items()},
                default_prompt_name=values.get("default_prompt_name") or None,
                hidden_size=int(values.get("hidden_size") or 0),
                pooling=tuple(json.loads(values.get("pooling") or '["mean"]')),
                include_prompt=values.get("include_prompt", "1") == "1",
                architecture=values.get("architecture", ""),
                representations=tuple(json.loads(values.get("representations") or '["dense"]')),
                revision=values.get("revision", ""),
                dtype=values.get("dtype", ""),
                tokenizer_fingerprint=values.get("tokenizer_fingerprint", ""),
                modalities=tuple(json.loads(values.get("modalities") or '["text"]')),
            )
        except (KeyError, ValueError, TypeError, AttributeError) as error:
            if isinstance(error, ModelCardError):
                raise
            raise ModelCardError(
                f"the model card on Redis is unreadable ({type(error).__name__}: {error}); "
                "restart a worker to publish it again"
            ) from None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def publish_card(client: aioredis.Redis, keys: Keys, card: ModelCard) -> None:
    """Write ``card`` to ``Keys.model``, replacing any older one whole (a field an older
    worker wrote and this card lacks must not survive)."""
    pipe = client.pipeline(transaction=True)  # one key: any slot, atomic on a cluster too
    pipe.delete(keys.model)
    # redis-py types `mapping` as Mapping[EncodableT, EncodableT], invariant in the key, which
    # no dict[str, str] matches although it is what hset takes
    pipe.hset(keys.model, mapping=card.to_fields())  # type: ignore[arg-type]
    await pipe.execute()


async def read_card(client: aioredis.Redis, keys: Keys) -> ModelCard | None:
    """The card the workers published, or None while no worker ever started in this
    namespace. ModelCardError for one that cannot be read."""
    fields = await client.hgetall(keys.model)
    return ModelCard.from_fields(fields) if fields else None
