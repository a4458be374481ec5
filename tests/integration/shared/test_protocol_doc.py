"""The protocol reference (docs/PROTOCOL.md) is generated from the code and says all it does.

Each message's table (shared/protocol_doc.py) is checked against what shared/protocol.py writes
and accepts; docs/PROTOCOL.md must hold the section as generated, and the README must link it;
and a query is asked of a real worker by following the documented steps with plain redis and
msgpack, as a client in another language would.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import msgpack
import numpy as np
import pytest
import redis.asyncio as aioredis

from embedfleet.shared import protocol_doc
from embedfleet.shared.dead_letters import DeadReason, dead_letter_fields
from embedfleet.shared.protocol import (
    Chunk,
    MultiVector,
    ProtocolError,
    Result,
    SparseVector,
    decode_chunk,
    encode_chunk,
    encode_query_error,
    encode_result,
)
from embedfleet.shared.protocol_doc import (
    CHUNK_FIELDS,
    DEAD_LETTER_FIELDS,
    ERROR_REPLY_FIELDS,
    QUERY_FIELDS,
    RESULT_FIELDS,
    WireField,
)
from embedfleet.shared.settings import Settings
from tests.conftest import WorkerLauncher
from tests.paths import REPO_ROOT

REPO = REPO_ROOT
PROTOCOL_DOC = REPO / protocol_doc.PROTOCOL_DOC
FIX = (
    "document it in shared/protocol_doc.py, then regenerate the block in "
    f"{protocol_doc.PROTOCOL_DOC}: {protocol_doc.WRITE_COMMAND}"
)


def _names(fields: tuple[WireField, ...]) -> set[str]:
    return {f.name for f in fields}


def _required(fields: tuple[WireField, ...]) -> list[str]:
    return [f.name for f in fields if f.required]


def test_protocol_doc_section_is_current() -> None:
    assert protocol_doc.protocol_section() in PROTOCOL_DOC.read_text(), (
        f"{protocol_doc.PROTOCOL_DOC}'s protocol section is stale: regenerate it with "
        f"`{protocol_doc.WRITE_COMMAND}` (from the repository root)"
    )


def test_the_readme_links_the_protocol_reference() -> None:
    assert f"]({protocol_doc.PROTOCOL_DOC})" in (REPO / "README.md").read_text()


def test_write_replaces_only_the_generated_block(tmp_path: Path) -> None:
    stale = tmp_path / "PROTOCOL.md"
    stale.write_text(
        f"# Protocol\n\nintro\n{protocol_doc.BEGIN}\nold table\n{protocol_doc.END}\n\noutro\n"
    )
    stale.write_text(protocol_doc.replace_section(stale.read_text()))
    text = stale.read_text()
    assert "old table" not in text and protocol_doc.protocol_section() in text
    assert text.startswith("# Protocol\n\nintro\n") and text.endswith("\n\noutro\n")


def test_every_field_the_code_writes_is_documented() -> None:
    every_option = Chunk(
        id="a",
        text="t",
        job="j",
        meta={"k": 1},
        prompt_name="query",
        prompt="q: ",
        dimensions=8,
        dtype="int8",
        representations=("sparse",),
        max_active_dims=4,
        pair="a document",
        multivector_dtype="int8",
        raw_scores=True,
        token_states=True,
        tenant="team-a",
        reembed=True,
        window_overlap=16,
        normalize=False,
        token_ids=b"\x65\x00\x00\x00",
        tokenizer="t1-0123",
    )
    written = set(msgpack.unpackb(encode_chunk(every_option)))
    # an image chunk carries ``image`` in place of ``text`` (never both)
    image = set(
        msgpack.unpackb(encode_chunk(Chunk(id="a", image=b"x", image_ref="a.png", job="j")))
    )
    assert image <= _names(CHUNK_FIELDS) and "text" not in image, f"chunk fields differ: {FIX}"
    assert written | image == _names(CHUNK_FIELDS), f"chunk fields differ: {FIX}"
    query = Chunk(id="a", text="t", reply="r", deadline_ms=1)
    query_only = set(msgpack.unpackb(encode_chunk(query))) - _names(CHUNK_FIELDS)
    assert query_only == _names(QUERY_FIELDS), f"query fields differ: {FIX}"

    result = Result(id="a", model="m", vector=np.zeros(4, np.float16), job="j", meta={"k": 1})
    assert set(msgpack.unpackb(encode_result(result))) <= _names(RESULT_FIELDS), FIX
    required = set(_required(RESULT_FIELDS))
    assert required <= set(msgpack.unpackb(encode_result(result))), FIX
    assert set(msgpack.unpackb(encode_query_error("a", "why"))) == _names(ERROR_REPLY_FIELDS), FIX
    sparse = SparseVector(indices=np.array([3], np.uint32), values=np.ones(1, np.float32), dim=9)
    other = Result(id="a", model="m", vector=np.ones(1, np.float32), sparse=sparse, score=1.0)
    assert set(msgpack.unpackb(encode_result(other))) <= _names(RESULT_FIELDS), FIX
    assert {"sparse", "score"} <= set(msgpack.unpackb(encode_result(other))), FIX
    tokens = MultiVector.of(np.ones((3, 4), np.float32), "int8")
    multi = Result(id="a", model="m", vector=np.ones(4, np.float16), multivector=tokens)
    written = msgpack.unpackb(encode_result(multi))
    assert "multivector" in written and set(written) <= _names(RESULT_FIELDS), FIX
    assert set(written["multivector"]) == {"dtype", "dim", "count", "data", "scales"}

    common = {"reason": DeadReason.INVALID, "detail": "d", "stream": "s", "entry_id": "1-0"}
    whole = dead_letter_fields(**common, payload=b"x", max_payload_bytes=8, chunk_id="a", job="j")
    prefix = dead_letter_fields(**common, payload=b"x" * 9, max_payload_bytes=8)
    assert set(whole) | set(prefix) == _names(DEAD_LETTER_FIELDS), f"dead letters: {FIX}"
    bare = dead_letter_fields(**common, payload=None, max_payload_bytes=8)
    assert set(bare) == set(_required(DEAD_LETTER_FIELDS)), FIX


@pytest.mark.parametrize("missing", _required(CHUNK_FIELDS))
def test_a_chunk_without_a_required_field_is_refused(missing: str) -> None:
    message = {"v": 1, "id": "a", "text": "some text"}
    assert set(message) == set(_required(CHUNK_FIELDS))  # the table's required fields
    assert decode_chunk(msgpack.packb(message)).id == "a"  # ... are enough
    del message[missing]
    with pytest.raises(ProtocolError):
        decode_chunk(msgpack.packb(message))


async def test_a_query_asked_by_the_documented_steps_alone_is_answered(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis, encoder
) -> None:
    """Steps 1-3 with plain redis and msgpack; nothing of embedfleet's client is used."""
    namespace = settings.namespace
    texts = ["where is the station", "how do I open a file"]
    request = uuid.uuid4().hex  # step 1
    async with workers.run(settings):
        deadline = int((time.time() + 60) * 1000)
        for n, text in enumerate(texts):  # step 2
            chunk = {"v": 1, "id": f"{request}:{n}", "text": text, "reply": request}
            chunk["deadline"] = deadline
            await client.xadd(f"{namespace}:query", {"m": msgpack.packb(chunk)})
        answers = {}
        while len(answers) < len(texts):  # step 3
            popped = await client.blpop([f"{namespace}:reply:{request}"], timeout=60)
            assert popped is not None, "no answer within 60 s"
            answer = msgpack.unpackb(popped[1])
            assert "error" not in answer, answer
            assert answer.keys() <= _names(RESULT_FIELDS)
            vector = np.frombuffer(answer["vec"], dtype="<f2")
            assert answer.get("dtype", "float16") == "float16"
            assert vector.shape == (answer["dim"],) == (encoder.dim,)
            answers[int(answer["id"].rsplit(":", 1)[1])] = vector.astype(np.float32)
        ttl = await client.ttl(f"{namespace}:reply:{request}")
    expected = encoder.embed_texts(texts)
    for n in range(len(texts)):
        cosine = answers[n] @ expected[n] / np.linalg.norm(answers[n]) / np.linalg.norm(expected[n])
        assert cosine > 0.99
    assert ttl == -2 or 0 < ttl <= settings.reply_ttl_s  # gone once emptied, or expiring
