"""Input settings: the limits every side checks chunks against, and how documents are cut."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from embedfleet.shared.protocol import DEFAULT_MAX_IMAGE_BYTES, ChunkLimits
from embedfleet.shared.settings.section import Section


class InputSettings(Section):
    """Limits on what is enqueued (sizes of payloads, texts, metadata, ids, dead letters) and
    the overlap of document chunks."""

    title: ClassVar[str] = "Input: limits and documents"

    max_message_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    """Largest msgpack payload accepted; bigger entries are dead-lettered."""
    max_text_chars: int = Field(default=1_000_000, ge=1)
    """Longest text accepted (characters); longer texts are dead-lettered."""
    max_meta_bytes: int = Field(default=16 * 1024, ge=0)
    """Largest metadata (msgpack-encoded) passed through to results."""
    max_image_bytes: int = Field(default=DEFAULT_MAX_IMAGE_BYTES, ge=1)
    """Largest image a chunk carries (its encoded bytes: JPEG, PNG, WebP, GIF), for a CLIP or
    SigLIP lane; bigger ones are dead-lettered (`too_large`). Keep it below
    `EMBEDFLEET_MAX_MESSAGE_BYTES`, which bounds the whole chunk."""
    image_sources: str = ""
    """Where a worker may read an image chunk sent by reference (its `image_ref` alone, no
    bytes), comma-separated: S3 prefixes (`s3://bucket` or `s3://bucket/prefix`, read with the
    Parquet store's settings: `EMBEDFLEET_S3_ENDPOINT_URL`, the `AWS_*` variables) and absolute
    folders on the workers' hosts (`/data/photos`). A reference elsewhere, or to an object that
    is missing, is dead-lettered (`source`). Empty: no reference is read."""
    max_id_chars: int = Field(default=512, ge=1)
    """Longest chunk id and job id accepted (characters)."""
    dead_payload_max_bytes: int = Field(default=64 * 1024, ge=0)
    """Dead letters keep the whole original payload up to this size, so `embedfleet dead replay` can
    re-enqueue it; bigger ones keep a 256-byte prefix."""
    document_overlap_tokens: int = Field(default=0, ge=0)
    """Tokens each document chunk shares with the one before it (`enqueue --documents`,
    `Producer.enqueue_documents`)."""
    producer_token_ids: bool = False
    """The producer tokenizes: `Producer.enqueue` (and `embedfleet enqueue`, the document
    splitter) sends each chunk's token ids, made with the tokenizer the lane's workers publish,
    so the workers' hosts spend no time tokenizing (a GPU host's cores feed the GPU). Needs the
    `tokenizers` package (the `[documents]` extra) and a worker that has started once."""

    @property
    def chunk_limits(self) -> ChunkLimits:
        """The limits every side validates chunks with (producer, JSONL reader, worker)."""
        return self.as_record(ChunkLimits)
