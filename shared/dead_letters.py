"""Dead letters: the reason codes, and the fields of an entry in the dead-letter stream.

Every dead letter carries a ``reason`` code from ``DeadReason`` (the metrics' label, the filter
of ``embedfleet dead list/replay/purge --reason``) and a ``detail`` text for a person. The code
says what kind of problem it was; rewording the detail never moves a letter to another code.

Fields are plain strings, for ``redis-cli XRANGE {ns}:dead - +``: ``reason``, ``detail``,
``stream``, ``entry_id``, ``deliveries``, ``id`` and ``job`` (when known), ``payload_bytes``,
and ``payload`` (the whole original msgpack payload, when it is at most
``EMBEDFLEET_DEAD_PAYLOAD_MAX_BYTES``: what ``embedfleet dead replay`` re-enqueues) or else
``payload_prefix`` (its first bytes, to see what it was).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

PAYLOAD_PREFIX_BYTES = 256


class DeadReason(StrEnum):
    """Why an entry was dead-lettered. The values are stable: dashboards and scripts use them."""

    NO_PAYLOAD = "no_payload"  # the entry has no 'm' field
    NOT_MSGPACK = "not_msgpack"  # 'm' is not msgpack (or not UTF-8 inside)
    TOO_LARGE = "too_large"  # over a size limit (payload, text, meta)
    INVALID = "invalid"  # msgpack, but not a valid v1 chunk (missing id, empty text, ...)
    TOO_LONG = "too_long"  # over the model's maximum tokens with EMBEDFLEET_TRUNCATE=false
    DELIVERIES = "deliveries"  # delivered EMBEDFLEET_MAX_DELIVERIES times, never acknowledged
    OPTIONS = "options"  # an option the served model cannot honour (prompt name, dimensions)
    MODEL = "model"  # the model failed on this text alone
    SINK_REFUSED = "sink_refused"  # the vector database refused this row alone
    TOKENIZER = "tokenizer"  # token ids made by another tokenizer than the model's (issue 53)
    # an image by reference outside EMBEDFLEET_IMAGE_SOURCES, or missing there (issue 56)
    SOURCE = "source"
    OTHER = "other"  # an entry without a known code (added by hand or by another tool)


def reason_help() -> str:
    """One line per code, for ``--help`` texts."""
    return ", ".join(reason.value for reason in DeadReason)


def dead_letter_fields(
    *,
    reason: DeadReason,
    detail: str,
    stream: str,
    entry_id: str,
    payload: bytes | None,
    max_payload_bytes: int,
    chunk_id: str | None = None,
    job: str | None = None,
    deliveries: int = 1,
) -> dict[str, str | bytes]:
    """Fields of a dead-letter entry: the whole payload when it fits the limit, else a prefix."""
    fields: dict[str, str | bytes] = {
        "reason": reason.value,
        "detail": detail,
        "stream": stream,
        "entry_id": entry_id,
        "deliveries": str(deliveries),
    }
    if chunk_id is not None:
        fields["id"] = chunk_id
    if job is not None:
        fields["job"] = job
    if payload is not None:
        fields["payload_bytes"] = str(len(payload))
        if len(payload) <= max_payload_bytes:
            fields["payload"] = payload
        else:
            fields["payload_prefix"] = payload[:PAYLOAD_PREFIX_BYTES]
    return fields


@dataclass(frozen=True)
class DeadLetter:
    """One entry of the dead-letter stream, read back."""

    dead_id: str  # the entry's id in the dead-letter stream
    reason: DeadReason
    detail: str
    stream: str
    entry_id: str
    deliveries: int
    chunk_id: str | None
    job: str | None
    payload: bytes | None  # the whole payload, None when only a prefix (or nothing) was kept
    payload_bytes: int | None
    payload_prefix: bytes | None

    @property
    def replayable(self) -> bool:
        return self.payload is not None

    @classmethod
    def from_fields(cls, dead_id: bytes | str, fields: dict[bytes, bytes]) -> DeadLetter:
        def text(name: bytes) -> str | None:
            value = fields.get(name)
            return None if value is None else value.decode("utf-8", "replace")

        raw_reason = text(b"reason") or ""
        try:
            reason = DeadReason(raw_reason)
        except ValueError:  # an entry a person or another tool added by hand: keep what it says
            reason = DeadReason.OTHER
        detail = text(b"detail") or ("" if reason.value == raw_reason else raw_reason)
        size = text(b"payload_bytes")
        return cls(
            dead_id=dead_id.decode() if isinstance(dead_id, bytes) else dead_id,
            reason=reason,
            detail=detail,
            stream=text(b"stream") or "",
            entry_id=text(b"entry_id") or "",
            deliveries=int(text(b"deliveries") or 1),
            chunk_id=text(b"id"),
            job=text(b"job"),
            payload=fields.get(b"payload"),
            payload_bytes=int(size) if size and size.isdigit() else None,
            payload_prefix=fields.get(b"payload_prefix"),
        )
