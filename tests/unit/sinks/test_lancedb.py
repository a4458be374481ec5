"""LanceDB's table layout (embedfleet/sinks/lancedb.py): the schema for each precision, and the
stored format read back from it."""

from __future__ import annotations

import pyarrow as pa

from embedfleet.sinks.backend import Extras
from embedfleet.sinks.lancedb import lance_schema, row_columns, stored_format


def test_the_schema_holds_the_precision_and_dimension() -> None:
    schema = lance_schema(48, "float16")
    assert schema.field("vector").type == pa.list_(pa.float16(), 48)
    assert stored_format(schema) == ("float16", 48)
    binary = lance_schema(20, "binary")  # packed bits: 3 bytes for 20 dimensions
    assert binary.field("vector").type == pa.list_(pa.uint8(), 3)
    assert stored_format(binary) == ("binary", 20)


def test_extras_add_their_columns_after_the_rows() -> None:
    plain = lance_schema(8)
    extra = lance_schema(8, extras=Extras(sparse_dim=100, multivector_dim=4))
    assert extra.names[: len(plain.names)] == plain.names
    assert len(extra.names) == len(plain.names) + 3
    assert "id" in row_columns(plain) and "vector" not in row_columns(plain)
