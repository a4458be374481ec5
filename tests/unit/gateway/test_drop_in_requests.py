"""The request side of the OpenAI and TEI drop-in (issue 54), in process: token ids of a tiktoken
encoding decoded (an encoding the test builds; a name never downloaded), model aliases, OpenAI's
300,000-token request limit, TEI's API_KEY, the loud start of a gateway open to the network,
unknown EMBEDFLEET_* variables named at start (gateway and worker), and a file of another
gateway's files folder told apart from a missing one. Nothing here reaches Redis or a worker."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import requests
import uvicorn
from click.testing import CliRunner
from fastapi.testclient import TestClient

from embedfleet.gateway.app import create_app
from embedfleet.gateway.auth import KeyChecker, load_api_keys
from embedfleet.gateway.batch.files import FileStore, folder_tag_of
from embedfleet.gateway.cli import is_loopback, serve_command
from embedfleet.gateway.errors import APIError
from embedfleet.gateway.inputs import as_texts, request_tokens
from embedfleet.gateway.token_ids import (
    TiktokenSettingError,
    load_tiktoken_ids,
    tiktoken_ids_of,
)
from embedfleet.producer.tokens import ModelTokenizer
from embedfleet.shared.model_path import resolve_model_path
from embedfleet.shared.modelcard import ModelCard
from embedfleet.shared.settings import Settings, SettingsError, load_settings
from embedfleet.shared.settings.composed import unknown_variables
from embedfleet.workers.cli import worker_command
from tests.tiktoken_support import built_encoding, write_encoding

TEXTS = ["the thing in there", "naïve café, ünïcode and emoji 🚀", "  spaces  "]
NO_REDIS = "redis://127.0.0.1:9"  # never reached here


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer(resolve_model_path("all-MiniLM-L6-v2"))


# --- token ids of a tiktoken encoding ------------------------------------------------------------


def test_ids_of_a_built_encoding_are_decoded_to_their_text(tmp_path: Path) -> None:
    encoding = built_encoding()
    ids = load_tiktoken_ids(str(write_encoding(tmp_path)))
    assert ids.vocab_size == encoding.n_vocab
    sent = [encoding.encode(text) for text in TEXTS]
    assert as_texts(sent, ids) == TEXTS
    assert as_texts(sent[0], ids) == TEXTS[:1]  # one list of ids is one input
    with pytest.raises(APIError) as outside:
        as_texts([[5, encoding.n_vocab]], ids)
    assert (outside.value.status, outside.value.code) == (400, "invalid_input")


def test_an_encoding_name_is_read_from_the_cache_and_never_downloaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fetched: list[str] = []
    monkeypatch.setattr(requests, "get", lambda url, *a, **k: fetched.append(url))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # empty: nothing cached
    with pytest.raises(TiktokenSettingError) as caught:
        tiktoken_ids_of("r50k_base")
    message = str(caught.value)
    assert "EMBEDFLEET_GATEWAY_TIKTOKEN_ENCODING='r50k_base'" in message
    assert "TIKTOKEN_CACHE_DIR" in message and "downloads nothing" in message
    assert fetched == []
    with pytest.raises(TiktokenSettingError, match="Unknown encoding"):
        tiktoken_ids_of("no_such_encoding")
    assert tiktoken_ids_of(None) is None


def test_token_ids_are_read_one_way_only() -> None:
    with pytest.raises(SettingsError, match="EMBEDFLEET_GATEWAY_TIKTOKEN_ENCODING"):
        load_settings(gateway_accept_token_ids=True, gateway_tiktoken_encoding="cl100k_base")


# --- model names ---------------------------------------------------------------------------------


def test_model_aliases_are_pairs() -> None:
    settings = Settings(gateway_model_aliases=" text-embedding-ada-002 = all-MiniLM-L6-v2 ,a=b")
    assert settings.model_aliases == {"text-embedding-ada-002": "all-MiniLM-L6-v2", "a": "b"}
    for bad in ("text-embedding-ada-002", "a=b,a=c", "=b"):
        with pytest.raises(SettingsError, match="EMBEDFLEET_GATEWAY_MODEL_ALIASES"):
            load_settings(gateway_model_aliases=bad)


# --- OpenAI's request limit ----------------------------------------------------------------------


def test_a_request_over_the_token_limit_gets_openais_answer(tokenizer: ModelTokenizer) -> None:
    card = ModelCard(name="all-MiniLM-L6-v2", dim=384, max_length=256, normalize=True)
    texts = ["hello " * 250] * 2  # 252 tokens each, with CLS and SEP
    at_limit = Settings(gateway_max_request_tokens=504)
    assert request_tokens(texts, tokenizer, card, at_limit, whole=False, refuse_long=True) == 504
    over = Settings(gateway_max_request_tokens=503)
    with pytest.raises(APIError) as caught:
        request_tokens(texts, tokenizer, card, over, whole=False, refuse_long=True)
    error = caught.value
    assert (error.status, error.type, error.code, error.param) == (
        400,
        "max_tokens_per_request",
        "max_tokens_per_request",
        None,
    )
    assert error.message == "Requested 504 tokens, max 503 tokens per request"
    assert Settings().gateway_max_request_tokens == 300_000  # OpenAI's


# --- keys ----------------------------------------------------------------------------------------


def test_teis_api_key_variable_is_a_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("API_KEY", "sk-tei")
    monkeypatch.setenv("EMBEDFLEET_API_KEYS", "sk-one")
    checker = KeyChecker(load_api_keys(load_settings()))
    checker.check("Bearer sk-tei")
    checker.check("Bearer sk-one")
    http = TestClient(create_app(load_settings(redis_url=NO_REDIS, files_dir=str(tmp_path))))
    assert http.get("/docs").status_code == 401  # closed: TEI's key counts
    assert http.get("/docs", headers={"Authorization": "Bearer sk-tei"}).status_code == 200


def test_an_open_gateway_on_the_network_says_so_loudly(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    started: list[dict] = []
    monkeypatch.setattr(uvicorn, "run", lambda *args, **options: started.append(options))
    monkeypatch.setenv("EMBEDFLEET_REDIS_URL", NO_REDIS)
    for variable in ("API_KEY", "EMBEDFLEET_API_KEYS", "EMBEDFLEET_API_KEYS_FILE"):
        monkeypatch.delenv(variable, raising=False)
    runner = CliRunner()
    exposed = runner.invoke(serve_command, ["--host", "0.0.0.0", "--port", "0"])
    assert exposed.exit_code == 0, exposed.output
    assert "NO API KEY: the gateway listens on 0.0.0.0" in exposed.stderr
    assert "EMBEDFLEET_API_KEYS" in exposed.stderr and "API_KEY" in exposed.stderr
    for quiet in (["--host", "127.0.0.1"], ["--host", "::1"], ["--host", "localhost"]):
        assert "NO API KEY" not in runner.invoke(serve_command, [*quiet, "--port", "0"]).stderr
    monkeypatch.setenv("API_KEY", "sk-tei")
    keyed = runner.invoke(serve_command, ["--host", "0.0.0.0", "--port", "0"])
    assert "NO API KEY" not in keyed.stderr
    assert len(started) == 5
    assert not is_loopback("gateway.internal") and is_loopback("127.0.0.2")


def test_unknown_variables_are_named_with_the_closest_setting_at_start(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(uvicorn, "run", lambda *args, **options: None)
    monkeypatch.setenv("EMBEDFLEET_REDIS_URL", NO_REDIS)
    monkeypatch.setenv("EMBEDFLEET_GATEWAY_API_KEYS", "sk-guessed")
    monkeypatch.setenv("EMBEDFLEET_TEST_ANYTHING", "1")  # the test suite's own: no warning
    caplog.set_level(logging.WARNING, logger="embedfleet.settings")
    assert CliRunner().invoke(serve_command, ["--port", "0"]).exit_code == 0
    warned = [record.getMessage() for record in caplog.records]
    assert any(
        "EMBEDFLEET_GATEWAY_API_KEYS is set but is no embedfleet setting" in message
        and "did you mean EMBEDFLEET_API_KEYS?" in message
        for message in warned
    ), warned
    assert not any("EMBEDFLEET_TEST_ANYTHING" in message for message in warned)
    # the worker reads its settings the same way (stopped here by a bad sink, before any model)
    caplog.clear()
    monkeypatch.setenv("EMBEDFLEET_REDIS_URLS", "redis://elsewhere")
    monkeypatch.setenv("EMBEDFLEET_SINK", "nosuchstore://x")
    assert CliRunner().invoke(worker_command, []).exit_code != 0
    assert any(
        "EMBEDFLEET_REDIS_URLS" in record.getMessage()
        and "did you mean EMBEDFLEET_REDIS_URL?" in record.getMessage()
        for record in caplog.records
    ), [record.getMessage() for record in caplog.records]


@pytest.mark.parametrize(
    ("variable", "hint"),
    [
        # a guessed section word, GATEWAY, in dozens of settings, counts for little beside API
        # and KEY (EMBEDFLEET_GATEWAY_API_KEY suggested EMBEDFLEET_GATEWAY_PORT)
        ("EMBEDFLEET_GATEWAY_API_KEY", "EMBEDFLEET_API_KEYS"),
        ("EMBEDFLEET_GATEWAY_API_KEYS", "EMBEDFLEET_API_KEYS"),
        ("EMBEDFLEET_GATEWAY_KEYS", "EMBEDFLEET_API_KEYS"),
        # the fleet's own list, never TEI's single-key alias
        ("EMBEDFLEET_API_KEY", "EMBEDFLEET_API_KEYS"),
        # unprefixed, a letter from TEI's API_KEY: a guess too
        ("API_KEYS", "EMBEDFLEET_API_KEYS"),
        ("APIKEY", "EMBEDFLEET_API_KEYS"),
        # typos inside a word or across a ``_``
        ("EMBEDFLEET_REDIS_URLS", "EMBEDFLEET_REDIS_URL"),
        ("EMBEDFLEET_REDISURL", "EMBEDFLEET_REDIS_URL"),
        ("EMBEDFLEET_NAMESAPCE", "EMBEDFLEET_NAMESPACE"),
        ("EMBEDFLEET_TOKENBUDGET", "EMBEDFLEET_TOKEN_BUDGET"),
        ("embedfleet_max_batches", "EMBEDFLEET_MAX_BATCH"),  # read in any case
        ("EMBEDFLEET_FOO", None),
    ],
)
def test_an_unknown_variable_is_told_the_setting_it_guessed_at(
    variable: str, hint: str | None
) -> None:
    (message,) = unknown_variables({variable: "x", "PATH": "/bin"})
    assert message.startswith(f"{variable} is set but is no embedfleet setting")
    said = f"did you mean {hint}?" if hint else "no setting has a like name"
    assert said in message, message


def test_settings_and_other_programs_variables_are_not_warned_about() -> None:
    known = {"API_KEY": "sk-tei", "EMBEDFLEET_API_KEYS": "sk-1", "EMBEDFLEET_REDIS_URL": NO_REDIS}
    others = {"HOME": "/root", "OPENAI_API_KEY": "sk-other", "EMBEDFLEET_TEST_ANYTHING": "1"}
    assert unknown_variables({**known, **others}) == []


# --- files folders -------------------------------------------------------------------------------


def test_a_file_of_another_folder_is_told_apart_from_a_missing_one(tmp_path: Path) -> None:
    first, shared = FileStore(tmp_path / "a"), FileStore(tmp_path / "a")
    other = FileStore(tmp_path / "b")
    assert first.folder_tag == shared.folder_tag != other.folder_tag  # kept in the folder
    upload = tmp_path / "upload"
    upload.write_text('{"custom_id": "a"}\n')
    stored = first.publish(upload, "in.jsonl", "batch")
    assert folder_tag_of(stored.id) == first.folder_tag
    assert shared.get(stored.id).id == stored.id
    with pytest.raises(APIError) as caught:
        other.get(stored.id)
    error = caught.value
    assert (error.status, error.code) == (404, "file_in_another_folder")
    assert "EMBEDFLEET_FILES_DIR" in error.message and "share one files folder" in error.message
    with pytest.raises(APIError) as missing:
        other.get(other.new_id())  # this folder's id, not there: the plain 404
    assert missing.value.code == "file_not_found"
