"""Long inputs embedded whole through the gateway (issue 42): a 3,000-token text sent to
/v1/embeddings (the `openai` SDK, ``extra_body={"window_overlap": 32}``), to TEI's /embed
(``"window_overlap": 32`` beside ``inputs``) and in a Batch API line's body comes back as one
embedding equal (cosine >= 0.999) to the by-hand reference of
tests/integration/workers/test_long_inputs.py: the model's tokenizer, windows of its length,
``SentenceTransformer``'s modules without Normalize on each, the token-weighted mean,
normalised. A real gateway, a real worker process, a real Redis."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from embedfleet.server import ServerProcess, isolated_settings
from embedfleet.shared.model_path import resolve_model_path
from tests.gateway_support import min_cosine, module_gateway_url, module_worker
from tests.integration.gateway.batch.test_api import (
    batch_line,
    create_batch,
    jsonl,
    upload,
    wait_final,
)
from tests.integration.workers.test_long_inputs import by_hand, long_text, token_counter

# the slow tier (make test-full, CI): starts a worker process and a gateway
pytestmark = pytest.mark.slow

OVERLAP = 32
MODEL_DIR = str(resolve_model_path("all-MiniLM-L6-v2"))


@pytest.fixture(scope="module")
def fleet_settings(redis_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory):
    return isolated_settings(
        redis_server.url,
        f"gl{uuid.uuid4().hex[:8]}",
        files_dir=str(tmp_path_factory.mktemp("files")),
        block_ms=200,
    )


worker = module_worker("gl")


gateway = module_gateway_url()


@pytest.fixture(scope="module")
def long_input() -> tuple[str, np.ndarray]:
    text = long_text(token_counter(MODEL_DIR))
    reference, _ = by_hand(MODEL_DIR, text, OVERLAP)
    return text, reference


def test_v1_embeddings_embeds_a_long_input_whole(gateway: str, long_input) -> None:
    text, reference = long_input
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)
    answer = client.embeddings.create(
        model="all-MiniLM-L6-v2",
        input=[text, "a short one"],
        extra_body={"window_overlap": OVERLAP},
        timeout=300,
    )
    assert len(answer.data) == 2  # one embedding per input
    agreement = min_cosine(np.array(answer.data[0].embedding), reference)
    print(f"LONG INPUT /v1/embeddings: cosine to the by-hand reference {agreement:.6f}")
    assert agreement >= 0.999
    # without the option, an input over the model's maximum is still OpenAI's 400
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="all-MiniLM-L6-v2", input=text, timeout=300)
    with pytest.raises(openai.BadRequestError):  # an overlap is a count of tokens
        client.embeddings.create(
            model="all-MiniLM-L6-v2", input=text, extra_body={"window_overlap": -1}, timeout=60
        )


def test_tei_embed_embeds_a_long_input_whole(gateway: str, long_input) -> None:
    text, reference = long_input
    answer = httpx.post(
        f"{gateway}/embed",
        json={"inputs": [text], "window_overlap": OVERLAP},
        timeout=300,
    )
    assert answer.status_code == 200, answer.text
    (vector,) = answer.json()
    agreement = min_cosine(np.array(vector), reference)
    print(f"LONG INPUT TEI /embed: cosine to the by-hand reference {agreement:.6f}")
    assert agreement >= 0.999
    refused = httpx.post(
        f"{gateway}/embed", json={"inputs": text, "window_overlap": -1}, timeout=60
    )
    assert refused.status_code == 422


# a number past every bound (2**70: past msgpack's 64 bits, where the gateway answered 500),
# past the protocol's own bound, negative, fractional, NaN and infinite (Python's JSON reads
# them) and strings: the caller's error in each dialect, never a 500 (values as JSON)
BAD_NUMBERS = ["1180591620717411303424", "18446744073709551616", "-1", "1.5", "2.0", "NaN"]
BAD_NUMBERS += ["Infinity", '"5"', '"five"']
PAST_BOUND = {"window_overlap": "1000001", "dimensions": "65537"}  # MAX_WINDOW_OVERLAP + 1, ...


@pytest.mark.parametrize("field", ["window_overlap", "dimensions"])
@pytest.mark.parametrize("value", [*BAD_NUMBERS, "past the bound"])
def test_a_bad_number_is_the_callers_error_in_each_dialect(
    gateway: str, field: str, value: str
) -> None:
    value = PAST_BOUND[field] if value == "past the bound" else value
    bodies = {
        "/v1/embeddings": '{"model": "all-MiniLM-L6-v2", "input": ["a text"], "%s": %s}',
        "/embed": '{"inputs": ["a text"], "%s": %s}',
    }
    statuses = {"/v1/embeddings": 400, "/embed": 422}  # OpenAI's and TEI's validation status
    for path, body in bodies.items():
        answer = httpx.post(
            f"{gateway}{path}",
            content=body % (field, value),
            headers={"content-type": "application/json"},
            timeout=60,
        )
        assert answer.status_code == statuses[path], (path, answer.status_code, answer.text)
        assert field in answer.text, answer.text  # the message names the field


def test_the_batch_api_embeds_a_long_line_whole(gateway: str, long_input, tmp_path: Path) -> None:
    """A Batch API line with ``window_overlap`` in its body is answered in the output file as
    one embedding, at parity; the same line without it is refused on its own (error file)."""
    text, reference = long_input
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)
    lines = [
        batch_line("whole", text, window_overlap=OVERLAP),
        batch_line("refused", text),
        batch_line("short", "a short one"),
    ]
    uploaded = upload(client, tmp_path / "long.jsonl", lines)
    batch = wait_final(client, create_batch(client, uploaded.id).id)
    assert batch.status == "completed", batch
    answered = {row["custom_id"]: row for row in jsonl(client, batch.output_file_id)}
    assert set(answered) == {"whole", "short"}
    data = answered["whole"]["response"]["body"]["data"]
    assert len(data) == 1
    agreement = min_cosine(np.array(data[0]["embedding"]), reference)
    print(f"LONG INPUT Batch API: cosine to the by-hand reference {agreement:.6f}")
    assert agreement >= 0.999
    errors = {row["custom_id"] for row in jsonl(client, batch.error_file_id)}
    assert errors == {"refused"}


def test_a_batch_line_with_a_bad_number_is_refused_on_its_own(gateway: str, tmp_path: Path) -> None:
    """A Batch API line whose window_overlap or dimensions is past its bound (2**70: past
    msgpack's 64 bits) is answered in the error file, naming the field; the batch completes
    and its other lines are embedded."""
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)
    lines = [
        batch_line("overlap", "a text", window_overlap=2**70),
        batch_line("dimensions", "a text", dimensions=2**70),
        batch_line("string", "a text", window_overlap="5"),
        batch_line("fine", "a text"),
    ]
    uploaded = upload(client, tmp_path / "bad_numbers.jsonl", lines)
    batch = wait_final(client, create_batch(client, uploaded.id).id)
    assert batch.status == "completed", batch
    answered = {row["custom_id"] for row in jsonl(client, batch.output_file_id)}
    assert answered == {"fine"}
    errors = {row["custom_id"]: row for row in jsonl(client, batch.error_file_id)}
    assert set(errors) == {"overlap", "dimensions", "string"}
    for field in ("overlap", "dimensions"):
        assert field in json.dumps(errors[field]), errors[field]
