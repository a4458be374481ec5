"""A results reader's consumer name (producer/results_reader.py): a fresh one per reader, and
the same one for every export to one file on this host (a rerun reads what a killed run
held)."""

from __future__ import annotations

import socket
from pathlib import Path

from embedfleet.producer.results_reader import default_reader_name, export_reader_name


def test_each_reader_gets_a_name_of_its_own() -> None:
    first, second = default_reader_name(), default_reader_name()
    assert first != second
    assert first.startswith(f"reader-{socket.gethostname()}-")


def test_an_export_to_one_file_always_gets_the_same_name(tmp_path: Path) -> None:
    out = tmp_path / "vectors.jsonl"
    name = export_reader_name(out)
    assert name == export_reader_name(tmp_path / "." / "vectors.jsonl")  # the resolved path
    assert name != export_reader_name(tmp_path / "other.jsonl")
    assert name.startswith(f"export-{socket.gethostname()}-") and len(name.rsplit("-", 1)[1]) == 12
