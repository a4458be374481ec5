"""Split documents into chunks, and a built-in corpus from text that ships with Python."""

from __future__ import annotations

import re
from collections.abc import Iterator

from embedfleet.shared.protocol import Chunk

_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")


def chunk_text(text: str, *, max_chars: int = 1200, min_chars: int = 40) -> list[str]:
    """Paragraph-based chunks: paragraphs are joined up to ``max_chars``; longer ones split at
    sentence ends, then hard-cut. Fragments under ``min_chars`` join their neighbour."""
    pieces: list[str] = []
    for paragraph in _PARAGRAPH_BREAK.split(text):
        paragraph = " ".join(paragraph.split())
        if not paragraph:
            continue
        while len(paragraph) > max_chars:
            cut = paragraph.rfind(". ", 0, max_chars)
            cut = cut + 1 if cut > max_chars // 3 else max_chars
            pieces.append(paragraph[:cut].strip())
            paragraph = paragraph[cut:].strip()
        if paragraph:
            pieces.append(paragraph)
    chunks: list[str] = []
    for piece in pieces:
        if (
            chunks
            and (len(piece) < min_chars or len(chunks[-1]) < min_chars)
            and (len(chunks[-1]) + len(piece) + 1 <= max_chars)
        ):
            chunks[-1] = f"{chunks[-1]} {piece}"
        else:
            chunks.append(piece)
    return chunks


def builtin_documents() -> dict[str, str]:
    """Python's own documentation topics (the text `help()` shows), ~0.8 MB of English prose."""
    from pydoc_data.topics import topics

    return dict(sorted(topics.items()))


def builtin_corpus(limit: int | None = None, *, max_chars: int = 1200) -> Iterator[Chunk]:
    """Chunks of the built-in documents, ids ``topic#n``, with the topic in meta."""
    produced = 0
    for topic, text in builtin_documents().items():
        for number, piece in enumerate(chunk_text(text, max_chars=max_chars)):
            if limit is not None and produced >= limit:
                return
            yield Chunk(id=f"{topic}#{number}", text=piece, meta={"topic": topic, "n": number})
            produced += 1
