"""Whole documents in: split with the model's own tokenizer into chunks that always fit it.

``semantic-text-splitter`` (Rust, maintained) cuts at the largest semantic unit that fits:
paragraphs, then sentences, then words, counting tokens with the same ``tokenizers.Tokenizer``
the worker uses (``tokenizer.json``, no torch). A chunk holds at most the model's maximum length
minus its special tokens ([CLS]/[SEP]) and the prompt's tokens, so the worker never truncates
one. Ids are ``<document id>#<n>``; every chunk carries the document's meta plus ``doc``, ``n``
and the character offsets ``start``/``end`` (``text[start:end]`` is the chunk).

Needs ``pip install 'embedfleet[documents]'`` (tokenizers, semantic-text-splitter).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embedfleet.producer.tokens import load_tokenizer
from embedfleet.shared.model_path import resolve_model_path
from embedfleet.shared.modelcard import ModelCard, max_input_tokens
from embedfleet.shared.protocol import Chunk

MARKDOWN_SUFFIXES = frozenset({".md", ".markdown"})


@dataclass(frozen=True)
class Document:
    id: str
    text: str
    meta: dict[str, Any] | None = None
    markdown: bool = False


def as_document(item: Document | Mapping[str, Any]) -> Document:
    """A Document, or a mapping like one JSONL line: {"id", "text", "meta"?, "markdown"?}."""
    if isinstance(item, Document):
        return item
    doc_id, text, meta = item.get("id"), item.get("text"), item.get("meta")
    if not isinstance(doc_id, str) or not doc_id:
        raise ValueError(f"document needs a non-empty string 'id', got {doc_id!r}")
    if not isinstance(text, str):
        raise ValueError(f"document {doc_id!r} needs a string 'text'")
    if meta is not None and not isinstance(meta, dict):
        raise ValueError(f"document {doc_id!r}: 'meta' must be an object")
    return Document(doc_id, text, meta, bool(item.get("markdown", False)))


@dataclass(frozen=True)
class SplitLimits:
    """What the splitter must know of the model besides its tokenizer: how many tokens fit and
    which prompt the worker puts in front of an ingest chunk."""

    name: str
    max_length: int
    prompts: dict[str, str]
    default_prompt_name: str | None = None

    @classmethod
    def of_card(cls, card: ModelCard) -> SplitLimits:
        """From the facts the workers published: what ``Producer.enqueue_documents`` uses."""
        return cls(card.name, card.max_length, card.prompts, card.default_prompt_name)

    @classmethod
    def declared(cls, model_dir: Path) -> SplitLimits:
        """From the directory's JSON files, for splitting before any worker has published its
        card (the demo's corpus, a split with no fleet): the same rule the worker applies
        (``max_input_tokens``), on the values the directory declares."""

        def read(name: str) -> dict[str, Any]:
            path = model_dir / name
            return json.loads(path.read_text()) if path.is_file() else {}

        config = read("config.json")
        st_config = read("config_sentence_transformers.json")
        max_length = max_input_tokens(
            read("sentence_bert_config.json").get("max_seq_length"),
            read("tokenizer_config.json").get("model_max_length"),
            config.get("max_position_embeddings"),
        )
        prompts = {str(k): str(v) for k, v in (st_config.get("prompts") or {}).items()}
        return cls(model_dir.name, max_length, prompts, st_config.get("default_prompt_name"))


class DocumentSplitter:
    """Splits documents for one model; build once, reuse (the tokenizer loads once)."""

    def __init__(
        self,
        model_dir: Path,
        limits: SplitLimits | None = None,
        *,
        overlap_tokens: int = 0,
        prompt_name: str | None = None,
    ) -> None:
        """``model_dir`` holds ``tokenizer.json``; ``limits`` default to what it declares."""
        try:
            from semantic_text_splitter import MarkdownSplitter, TextSplitter
        except ImportError as error:
            raise ImportError(
                "splitting documents needs semantic-text-splitter: "
                "pip install 'embedfleet[documents]'"
            ) from error
        limits = limits or SplitLimits.declared(model_dir)
        self.limits = limits
        self.tokenizer = load_tokenizer(model_dir)
        self.special_tokens = len(self.tokenizer.encode("", add_special_tokens=True).ids)
        # the prompt the worker puts in front of an ingest chunk: the one named, else the
        # model's document/passage prompt, else its default one
        name = prompt_name or next(
            (n for n in ("document", "passage") if n in limits.prompts), limits.default_prompt_name
        )
        prompt = limits.prompts.get(name, "") if name else ""
        self.prompt_tokens = (
            len(self.tokenizer.encode(prompt, add_special_tokens=False).ids) if prompt else 0
        )
        self.capacity = limits.max_length - self.special_tokens - self.prompt_tokens
        if self.capacity < 8:
            raise ValueError(f"{limits.name} leaves only {self.capacity} tokens for text")
        if not 0 <= overlap_tokens < self.capacity:
            raise ValueError(
                f"overlap of {overlap_tokens} tokens must be below the chunk size {self.capacity} "
                "(EMBEDFLEET_DOCUMENT_OVERLAP_TOKENS)"
            )
        # A chunk counts as full from half the capacity: without the range the splitter keeps
        # to the largest semantic unit that fits and leaves many tiny chunks (a 144-character
        # "Changed in version" line on its own), which embed poorly and rank above the text.
        capacity = (self.capacity // 2, self.capacity)
        self._text = TextSplitter.from_huggingface_tokenizer(
            self.tokenizer, capacity=capacity, overlap=overlap_tokens
        )
        self._markdown = MarkdownSplitter.from_huggingface_tokenizer(
            self.tokenizer, capacity=capacity, overlap=overlap_tokens
        )

    def split(self, document: Document | Mapping[str, Any], job: str | None = None) -> list[Chunk]:
        doc = as_document(document)
        splitter = self._markdown if doc.markdown else self._text
        chunks = []
        for number, (start, piece) in enumerate(splitter.chunk_indices(doc.text)):
            meta = {**(doc.meta or {}), "doc": doc.id, "n": number}
            meta.update(start=start, end=start + len(piece))
            chunks.append(Chunk(id=f"{doc.id}#{number}", text=piece, job=job, meta=meta))
        return chunks

    def split_all(
        self, documents: Iterable[Document | Mapping[str, Any]], job: str | None = None
    ) -> Iterator[Chunk]:
        for document in documents:
            yield from self.split(document, job)


def read_documents(
    paths: Iterable[Path], reject: Callable[[int, str], None] | None = None
) -> Iterator[Document]:
    """Text and Markdown files (id: the path as given), or JSONL files of {"id", "text",
    "meta"} documents, one per line.

    A document it cannot read (not UTF-8, not JSON, not a document) raises ValueError naming
    the file and line; with ``reject``, it is passed to ``reject(line number, reason)``
    instead and the rest are still read (`embedfleet enqueue --documents`: exit status 4)."""

    def bad(number: int, reason: str) -> None:
        if reject is None:
            raise ValueError(f"{reason} (line {number})")
        reject(number, reason)

    for path in paths:
        if path.suffix.lower() == ".jsonl":
            with path.open("rb") as handle:
                for number, raw in enumerate(handle, start=1):
                    try:
                        line = raw.decode("utf-8")
                        if not line.strip():
                            continue
                        document = as_document(json.loads(line))
                    except (ValueError, json.JSONDecodeError) as error:  # UnicodeDecodeError too
                        bad(number, f"{path}: {error}")
                        continue
                    yield document
        else:
            data = path.read_bytes()
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as error:
                number = data.count(b"\n", 0, error.start) + 1
                bad(number, f"{path}: not UTF-8 (byte 0x{data[error.start]:02x}, {error.reason})")
                continue
            yield Document(
                id=str(path),
                text=text,
                meta={"path": str(path)},
                markdown=path.suffix.lower() in MARKDOWN_SUFFIXES,
            )


def builtin_document_chunks(
    limit: int | None = None, *, model: str | None = None, overlap_tokens: int = 0
) -> Iterator[Chunk]:
    """The built-in corpus (Python's documentation topics) split as documents for ``model``
    (default: EMBEDFLEET_MODEL): what `embedfleet demo` embeds without --corpus."""
    from embedfleet.producer.chunker import builtin_documents
    from embedfleet.shared.settings import Settings

    splitter = DocumentSplitter(
        resolve_model_path(model or Settings().model), overlap_tokens=overlap_tokens
    )
    documents = (
        Document(id=topic, text=text, meta={"topic": topic})
        for topic, text in builtin_documents().items()
    )
    for produced, chunk in enumerate(splitter.split_all(documents)):
        if limit is not None and produced >= limit:
            return
        yield chunk
