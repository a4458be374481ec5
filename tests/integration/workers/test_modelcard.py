"""shared/modelcard.py: the facts a worker publishes about its model, written from the loaded
encoder, read back by the gateway and the Producer; the served-name and max-length rules."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis.asyncio as aioredis

from embedfleet.shared.modelcard import (
    ModelCard,
    ModelCardError,
    max_input_tokens,
    publish_card,
    read_card,
    served_name,
)
from embedfleet.shared.protocol import Chunk
from embedfleet.shared.settings import Settings
from tests import model_zoo
from tests.cards import tiny_card

CARD = tiny_card(
    default_prompt_name="passage",
    hidden_size=32,
    pooling=("mean", "cls"),
    include_prompt=False,
    architecture="BertModel",
    dtype="bfloat16",
)


def test_fields_round_trip_and_read_as_redis_returns_them() -> None:
    fields = CARD.to_fields()
    assert all(isinstance(v, str) for v in fields.values())  # redis-cli HGETALL reads it
    assert ModelCard.from_fields(fields) == CARD
    as_bytes = {k.encode(): v.encode() for k, v in fields.items()}
    assert ModelCard.from_fields(as_bytes) == CARD


def test_a_card_from_an_older_worker_and_one_from_a_newer() -> None:
    # what workers wrote before the card had a layout version
    old = {"name": "m", "dim": "384", "normalize": "1", "max_length": "256", "prompts": "{}"}
    card = ModelCard.from_fields(old)
    assert (card.dim, card.normalize, card.default_prompt_name, card.pooling, card.dtype) == (
        384,
        True,
        None,
        ("mean",),
        "",  # the precision is not known: /info says null
    )
    with pytest.raises(ModelCardError, match=r"newer worker.*upgrade embedfleet"):
        ModelCard.from_fields({**CARD.to_fields(), "version": "99"})
    with pytest.raises(ModelCardError, match="restart a worker"):
        ModelCard.from_fields({"name": "m", "dim": "many"})


async def test_publish_replaces_the_card_whole_and_read_finds_it(
    settings: Settings, client: aioredis.Redis
) -> None:
    assert await read_card(client, settings.keys) is None  # no worker ever started here
    await client.hset(settings.keys.model, mapping={"stale": "from an old worker"})
    await publish_card(client, settings.keys, CARD)
    assert await read_card(client, settings.keys) == CARD
    assert b"stale" not in await client.hkeys(settings.keys.model)


def test_check_refuses_what_the_model_cannot_honour() -> None:
    CARD.check(Chunk(id="a", text="t", dimensions=48, prompt_name="passage"))
    CARD.check(Chunk(id="a", text="t", prompt_name="document"))  # ST's predefined, empty
    CARD.check(Chunk(id="a", text="t", dimensions=0))  # the whole vector
    with pytest.raises(ValueError, match="dimensions=49 is more than the model 'tiny' has"):
        CARD.check(Chunk(id="a", text="t", dimensions=49))
    with pytest.raises(ValueError, match="prompt_name='nope' is not one of"):
        CARD.check(Chunk(id="a", text="t", prompt_name="nope"))
    assert CARD.prompt_text("query") == "q: " and CARD.prompt_text("document") == ""


def test_the_served_name_and_max_length_rules() -> None:
    assert served_name("all-MiniLM-L6-v2") == "all-MiniLM-L6-v2"
    assert served_name("sentence-transformers/all-MiniLM-L6-v2") == "all-MiniLM-L6-v2"
    assert served_name("/models/bge-small/") == "bge-small"
    assert max_input_tokens(256, 512, 512) == 256  # sentence_bert_config's max_seq_length
    assert max_input_tokens(None, 8192, 512) == 512  # tokenizer capped at the positions
    assert max_input_tokens(None, None, None) == 512


@pytest.mark.parametrize(
    ("build", "dim", "normalize"),
    [
        # a Dense head: its out_features, not the hidden size
        (lambda root: model_zoo.sentence_transformers_dir("bert", root, dense=24), 24, True),
        # concatenated pooling: twice the hidden size
        (
            lambda root: model_zoo.sentence_transformers_dir(
                "bert", root, pooling=("mean", "cls"), normalize=False
            ),
            "2h",
            False,
        ),
        # a plain Hugging Face directory: mean pooling, not normalised
        (lambda root: model_zoo.hf_model_dir("bert", root), "h", False),
    ],
)
def test_the_worker_publishes_what_it_loaded(build, dim, normalize, tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    from embedfleet.workers.model.encoder import Encoder

    model_dir = build(tmp_path)
    card = Encoder(str(model_dir), device="cpu").card
    reference = SentenceTransformer(str(model_dir), device="cpu")
    expected_dim = {"h": card.hidden_size, "2h": 2 * card.hidden_size}.get(dim, dim)
    assert card.dim == expected_dim == reference.get_embedding_dimension()
    assert card.normalize is normalize
    assert card.max_length == reference.max_seq_length
    assert card.name == model_dir.name and card.architecture == "BertModel"


async def test_a_producer_reads_the_card_it_checks_chunks_against(
    settings: Settings, client: aioredis.Redis
) -> None:
    from embedfleet.producer.client import Producer

    async def hgetall_calls() -> int:
        stats = await client.info("commandstats")
        return int(stats.get("cmdstat_hgetall", {}).get("calls", 0))

    async with Producer(settings, client) as producer:
        # no worker ever started: chunks go out unchecked, without one read per chunk
        before = await hgetall_calls()
        chunks = [{"id": f"c{n}", "text": "t", "dimensions": 4096} for n in range(200)]
        assert await producer.enqueue(chunks) == 200
        assert await hgetall_calls() - before <= 2
    await publish_card(client, settings.keys, CARD)
    async with Producer(settings, client) as producer:
        assert await producer.model_card() == CARD
        with pytest.raises(ValueError, match="dimensions=4096 is more than the model 'tiny'"):
            await producer.enqueue([{"id": "x", "text": "t", "dimensions": 4096}])
