"""The built-in chunker (producer/chunker.py): paragraphs joined up to a size, long ones cut at
sentence ends, short fragments joined to a neighbour."""

from __future__ import annotations

from itertools import islice

from embedfleet.producer.chunker import builtin_corpus, chunk_text


def test_paragraphs_are_joined_up_to_the_size_and_whitespace_is_collapsed() -> None:
    text = "First  paragraph\nstill first.\n\n  \n\nSecond paragraph."
    assert chunk_text(text, max_chars=100, min_chars=0) == [
        "First paragraph still first.",
        "Second paragraph.",
    ]
    # a fragment under min_chars joins its neighbour when the two fit
    assert chunk_text(text, max_chars=100, min_chars=40) == [
        "First paragraph still first. Second paragraph."
    ]


def test_a_long_paragraph_is_cut_at_a_sentence_end_else_hard() -> None:
    sentence = "This sentence has exactly forty chars.. "
    text = sentence * 5
    chunks = chunk_text(text, max_chars=100, min_chars=0)
    assert all(len(chunk) <= 100 for chunk in chunks)
    assert all(chunk.endswith(".") for chunk in chunks[:-1])  # cut after a full stop
    assert " ".join(chunks) == " ".join(text.split())
    unbroken = "x" * 250  # no sentence end: cut at the size
    assert [len(c) for c in chunk_text(unbroken, max_chars=100, min_chars=0)] == [100, 100, 50]


def test_the_builtin_corpus_names_each_chunk_by_topic_and_number() -> None:
    first = list(islice(builtin_corpus(limit=3), 10))
    assert len(first) == 3
    topic = first[0].meta["topic"]
    assert [c.id for c in first][:1] == [f"{topic}#0"]
    assert all(c.meta["n"] == int(c.id.rsplit("#", 1)[1]) for c in first)
    assert all(0 < len(c.text) <= 1200 for c in first)
