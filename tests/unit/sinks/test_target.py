"""Where vectors go (embedfleet/sinks/target.py): a target described without secrets, a
table name checked, a URL's directory required."""

from __future__ import annotations

import pytest

from embedfleet.sinks.target import SinkTarget, SinkURL, SinkURLError, check_table


def test_a_target_is_described_without_its_password() -> None:
    target = SinkTarget(kind="pgvector", location="postgresql://u:secret@db:5432/x", table="t")
    said = target.describe()
    assert "secret" not in said and "postgresql://u:***@db:5432/x" in said
    assert said == "the pgvector sink 't' at postgresql://u:***@db:5432/x"
    described = SinkTarget(
        "lancedb", "/data", "emb", described="LanceDB table {table!r} in {location}"
    )
    assert described.describe() == "LanceDB table 'emb' in /data"


def test_table_names() -> None:
    for good in ("embeddings", "_t1", "a" * 63):
        check_table(good)
    for bad in ("", "1abc", "a-b", "a" * 64, "x; drop table y"):
        with pytest.raises(SinkURLError, match="is not a valid table name"):
            check_table(bad)


def test_a_url_without_a_directory_is_refused() -> None:
    url = SinkURL("lancedb:///", "lancedb", "/", "t", "")
    with pytest.raises(SinkURLError, match="names no directory"):
        url.path()
    assert SinkURL("lancedb:///data/x", "lancedb", "/data/x", "t", "").path() == "/data/x"
