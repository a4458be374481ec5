"""Whole documents in: split with the model's own tokenizer, never over its maximum length."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import msgpack
import pytest
import redis.asyncio as aioredis
from click.testing import CliRunner

from embedfleet.cli import main
from embedfleet.producer.chunker import builtin_documents
from embedfleet.producer.client import Producer
from embedfleet.producer.documents import Document, DocumentSplitter, builtin_document_chunks
from embedfleet.shared.model_path import resolve_model_path
from embedfleet.shared.protocol import PAYLOAD_FIELD
from embedfleet.shared.settings import Settings

MODEL = "all-MiniLM-L6-v2"


def test_no_chunk_of_the_builtin_corpus_is_over_the_models_maximum(encoder) -> None:
    chunks = list(builtin_document_chunks())
    documents = builtin_documents()
    assert len(chunks) > 500
    # re-tokenized exactly as the worker does: nothing is truncated
    tokenized = encoder.tokenize([chunk.text for chunk in chunks])
    lengths = [t.length for t in tokenized]
    assert not any(t.truncated for t in tokenized)
    assert max(lengths) <= encoder.max_length == 256
    assert max(lengths) >= 200  # and the chunks are filled, not tiny
    for chunk in chunks:
        meta = chunk.meta or {}
        assert chunk.id == f"{meta['doc']}#{meta['n']}" and meta["topic"] == meta["doc"]
        assert documents[meta["doc"]][meta["start"] : meta["end"]] == chunk.text


def test_prompt_and_special_tokens_come_off_the_chunk_size(tmp_path: Path) -> None:
    source = resolve_model_path(MODEL)
    model_dir = tmp_path / "prompted"
    shutil.copytree(source, model_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    (model_dir / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"passage": "passage: "}, "default_prompt_name": "passage"})
    )
    plain = DocumentSplitter(resolve_model_path(MODEL))
    prompted = DocumentSplitter(model_dir)
    assert plain.capacity == 256 - 2  # [CLS] and [SEP]
    assert prompted.prompt_tokens == 2  # "passage", ":"
    assert prompted.capacity == 256 - 2 - 2
    text = builtin_documents()["assert"] * 3
    for chunk in prompted.split({"id": "d", "text": text}):
        ids = prompted.tokenizer.encode("passage: " + chunk.text).ids
        assert len(ids) <= 256


def test_overlap_is_a_setting_and_offsets_slice_back() -> None:
    text = builtin_documents()["compound"]
    splitter = DocumentSplitter(resolve_model_path(MODEL), overlap_tokens=40)
    chunks = splitter.split(Document("compound", text, {"source": "pydoc"}))
    assert len(chunks) > 5
    # overlap is an upper bound (the splitter keeps to semantic boundaries): many neighbours
    # share text with it, none without it
    plain = DocumentSplitter(resolve_model_path(MODEL)).split(Document("compound", text))
    assert sum(a.meta["start"] < b.meta["end"] for b, a in itertools.pairwise(plain)) == 0
    shared = [
        text[a.meta["start"] : b.meta["end"]]
        for b, a in itertools.pairwise(chunks)
        if a.meta["start"] < b.meta["end"]
    ]
    assert len(shared) >= 5
    encode = splitter.tokenizer.encode
    assert all(len(encode(s, add_special_tokens=False).ids) <= 40 for s in shared)
    assert all(text[c.meta["start"] : c.meta["end"]] == c.text for c in chunks)
    assert chunks[0].meta["source"] == "pydoc"
    with pytest.raises(ValueError, match="EMBEDFLEET_DOCUMENT_OVERLAP_TOKENS"):
        DocumentSplitter(resolve_model_path(MODEL), overlap_tokens=254)


async def test_producer_enqueues_documents(settings: Settings, client: aioredis.Redis) -> None:
    documents = [
        {"id": "guide", "text": builtin_documents()["with"], "meta": {"lang": "en"}},
        {"id": "short", "text": "One short document."},
    ]
    async with Producer(settings, client) as producer:
        count = await producer.enqueue_documents(documents, job="docs")
        progress = await producer.progress("docs")
    entries = await client.xrange(settings.keys.ingest)
    payloads = [msgpack.unpackb(fields[PAYLOAD_FIELD]) for _, fields in entries]
    assert count == len(payloads) == progress.enqueued > 2
    ids = [p["id"] for p in payloads]
    assert ids[-1] == "short#0" and ids[0] == "guide#0" and "guide#1" in ids
    assert payloads[0]["meta"]["lang"] == "en" and payloads[0]["meta"]["start"] == 0
    assert all(p["job"] == "docs" for p in payloads)


def test_cli_enqueues_text_markdown_and_jsonl_documents(settings: Settings, tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text(builtin_documents()["if"])
    (tmp_path / "readme.md").write_text("# Title\n\nSome *markdown* text.\n\n## Part\n\nMore.\n")
    (tmp_path / "docs.jsonl").write_text(
        json.dumps({"id": "j1", "text": "A JSONL document.", "meta": {"k": 1}}) + "\n"
    )
    result = CliRunner().invoke(
        main,
        [
            "enqueue",
            "--documents",
            str(tmp_path / "notes.txt"),
            str(tmp_path / "readme.md"),
            str(tmp_path / "docs.jsonl"),
            "--job",
            "cli-docs",
            "--overlap",
            "16",
        ],
        env={
            "EMBEDFLEET_REDIS_URL": settings.effective_redis_url,
            "EMBEDFLEET_NAMESPACE": settings.namespace,
        },
    )
    assert result.exit_code == 0, result.output
    assert "of 3 sources as job 'cli-docs'" in result.output
    bad = CliRunner().invoke(main, ["enqueue", "a.jsonl", "b.jsonl"])
    assert bad.exit_code != 0 and "--documents" in bad.output
