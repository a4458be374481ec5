"""A Batch API input file's request lines, checked in two parts, as OpenAI's Batch API does:

- the file's own form (``read_envelope``: a JSON object, ``custom_id``, ``method``, ``url``, the
  model, and in ``validate_file`` duplicate ids and the batch caps): a fault there fails the
  whole batch in its validating step, with ``errors`` naming the lines;
- each request's body (``read_request``), checked as the online endpoint checks a request, by
  the same owners (openai_api's ``EmbeddingRequest``, inputs.py's limits, ``check_dimensions``,
  ``request_tokens``): a request refused there is answered on its own, in the batch's error file
  with the status and error body the online endpoint would give it, and the batch goes on.

Which request lines were refused is a bitmap (``Refused``), kept in the batch's hash, so the
slices skip them and the output step answers them without checking them again."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from embedfleet.gateway.batch.files import bounded_lines
from embedfleet.gateway.errors import APIError
from embedfleet.gateway.images import Input, require_image_uris, text_positions, texts_of
from embedfleet.gateway.inputs import (
    check_dimensions,
    openai_truncate,
    prepare_inputs,
    request_tokens,
)
from embedfleet.gateway.openai_api import EmbeddingRequest
from embedfleet.gateway.state import Gateway
from embedfleet.shared.protocol import ProtocolError, check_window_overlap
from embedfleet.shared.settings import Settings

ENDPOINT = "/v1/embeddings"
SHOWN_LINE_ERRORS = 100  # errors.data entries a failed batch keeps (its object is in Redis)


@dataclass(frozen=True)
class BatchLine:
    custom_id: str
    # texts, and images' encoded bytes (data URIs on a CLIP or SigLIP lane: gateway/images.py)
    inputs: list[Input]
    encoding_format: str
    dimensions: int | None
    # the body's window_overlap: its inputs over the model's maximum embedded whole (issue 42)
    window_overlap: int | None = None

    @property
    def texts(self) -> list[str]:
        """The texts among the line's inputs (what ``usage`` counts: an image counts none)."""
        return texts_of(self.inputs)


def read_envelope(raw: bytes, gateway: Gateway) -> tuple[str, Any]:
    """A request line's ``custom_id`` and ``body``, once the line is a well-formed request of
    this batch: JSON, ``custom_id``, ``method``, ``url``, and a model this gateway serves (a
    batch is for one endpoint and one model). APIError otherwise: a malformed file."""
    try:
        line = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise APIError(400, f"not JSON: {error}", code="invalid_json_line") from None
    if not isinstance(line, dict):
        raise APIError(400, "each line must be a JSON object", code="invalid_json_line")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise APIError(
            400,
            "'custom_id' must be a non-empty string",
            param="custom_id",
            code="invalid_request",
        )
    if line.get("method") != "POST":
        raise APIError(400, "'method' must be \"POST\"", param="method", code="invalid_request")
    if line.get("url") != ENDPOINT:
        raise APIError(
            400,
            f"'url' must be {ENDPOINT!r} (the only batch endpoint)",
            param="url",
            code="url_mismatch",
        )
    body = line.get("body")
    if isinstance(body, dict) and "model" in body:  # no model: the request's own 400
        gateway.check_model(body["model"], "body.model")
    return custom_id, body


def read_request(
    custom_id: str, body: Any, gateway: Gateway, *, validating: bool = False, sent: bool = False
) -> BatchLine:
    """A request's body checked as the online endpoint checks it; APIError (the status and
    error the endpoint would answer) says why not. The context check runs in the validating
    step only (``validating``): a line that passed it is never refused later, when the card
    may have become known. ``sent``: a line already sent, read back for its output; the card's
    checks are not run again (the worker refused what the card it had then refused)."""
    try:
        request = EmbeddingRequest.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(
            400,
            f"body{'.' if where else ''}{where}: {first.get('msg')}",
            param="body",
            code="invalid_request",
        ) from None
    card = gateway.known_card  # None before any worker published: the worker checks
    if request.modality == "image":  # as online: images alone, URLs refused
        require_image_uris(request.input, "body.input")
    if not sent:
        check_dimensions(request.dimensions, card)
    try:
        # the protocol's bound, checked here as the line is read: the slice that sends it
        # would otherwise fail whole (the Producer refuses the chunk), and the batch with it
        check_window_overlap(request.window_overlap)
    except ProtocolError as error:
        raise APIError(
            400, f"body.{error}", param="body.window_overlap", code="invalid_request"
        ) from None
    # the line's "truncate", else the /v1 default (EMBEDFLEET_GATEWAY_OPENAI_TRUNCATE: off,
    # OpenAI's refusal), as online
    truncate = openai_truncate(request.truncate, gateway.settings)
    settings = gateway.settings
    # as online: images decoded, held against the card's modalities (not again once sent)
    modalities = None if card is None or sent else card.modalities
    inputs = prepare_inputs(
        request.input, gateway.openai_ids, settings, modalities, "body.input", truncate=truncate
    )
    whole = request.window_overlap is not None  # as online: embedded whole, in windows
    if validating and card is not None:  # as online: over the context refused, not cut
        request_tokens(
            texts_of(inputs),
            gateway.tokenizer,
            card,
            settings,
            whole=whole,
            refuse_long=not (truncate or whole),
            param="body.input",
            positions=text_positions(inputs),
        )
    return BatchLine(
        custom_id, inputs, request.encoding_format, request.dimensions, request.window_overlap
    )


def parse_line(
    raw: bytes, gateway: Gateway, *, validating: bool = False, sent: bool = False
) -> BatchLine:
    """One JSONL request line, its form and its request (``read_envelope``, ``read_request``)."""
    custom_id, body = read_envelope(raw, gateway)
    return read_request(custom_id, body, gateway, validating=validating, sent=sent)


def refusal(raw: bytes, gateway: Gateway) -> APIError:
    """Why a request line the validating step refused is refused, for its error file line: the
    same check again (the card the output step read). Should it pass now (the fleet's model
    changed meanwhile), it is still answered as refused: its inputs were never sent."""
    custom_id, body = read_envelope(raw, gateway)
    try:
        read_request(custom_id, body, gateway, validating=True)
    except APIError as error:
        return error
    return APIError(
        400,
        "the request was refused when the batch was validated; send it again in a new batch",
        code="invalid_request",
    )


@dataclass
class Refused:
    """The request lines (numbered from 0, blank lines not counted) answered with an error of
    their own, never sent: one bit each, the form kept in the batch's hash (``refused``)."""

    bits: bytearray = field(default_factory=bytearray)

    @classmethod
    def of(cls, stored: bytes | None) -> Refused:
        return cls(bytearray(stored or b""))

    def add(self, number: int) -> None:
        byte = number // 8
        if byte >= len(self.bits):
            self.bits.extend(bytes(byte + 1 - len(self.bits)))
        self.bits[byte] |= 1 << (number % 8)

    def __contains__(self, number: int) -> bool:
        byte = number // 8
        return byte < len(self.bits) and bool(self.bits[byte] >> (number % 8) & 1)

    def count(self, below: int | None = None) -> int:
        """How many are refused (of the lines before ``below``)."""
        if below is None:
            return sum(byte.bit_count() for byte in self.bits)
        whole, rest = divmod(below, 8)
        counted = sum(byte.bit_count() for byte in self.bits[:whole])
        if rest and whole < len(self.bits):
            counted += (self.bits[whole] & ((1 << rest) - 1)).bit_count()
        return counted


def line_error(
    code: str, message: str, line: int | None = None, param: str | None = None
) -> dict[str, Any]:
    """One entry of a failed batch's ``errors.data`` (OpenAI's BatchError)."""
    return {"code": code, "message": message, "param": param, "line": line}


@dataclass
class Validation:
    """What the validating step found in an input file: its request lines, the inputs of those
    it accepted, the lines it refused on their own (``refused``) and, for a malformed file or
    one over the caps, ``errors`` (the batch fails)."""

    lines: int = 0
    inputs: int = 0
    refused: Refused = field(default_factory=Refused)
    errors: list[dict[str, Any]] | None = None


def validate_file(path: Path, gateway: Gateway) -> Validation:
    """Every request line of a batch input file checked, and the batch caps; blocking (run it
    in a thread). Line numbers count from 1 over the file as written, blank lines included."""
    settings = gateway.settings
    found = Validation()
    faults = LineFaults()
    seen_ids: set[str] = set()
    with path.open("rb") as handle:
        # bounded: a line over the cap (a file stored before it was lowered) is never held
        for number, raw in enumerate(bounded_lines(handle, settings.batch_max_line_bytes), 1):
            if raw is None:
                found.lines += 1
                faults.add(
                    "line_too_large",
                    f"the line is over {settings.batch_max_line_bytes:,} bytes "
                    "(EMBEDFLEET_BATCH_MAX_LINE_BYTES)",
                    number,
                )
            elif raw.strip():
                check_line(raw, number, gateway, found, faults, seen_ids)
    caps = cap_errors(found, settings)
    listed = faults.listed()
    if caps or listed:
        found.errors = caps + listed
    return found


@dataclass
class LineFaults:
    """The faults of a file's request lines that fail the batch: each counted, the first
    SHOWN_LINE_ERRORS listed (the batch's object is in Redis)."""

    shown: list[dict[str, Any]] = field(default_factory=list)
    count: int = 0

    def add(self, code: str, message: str, line: int, param: str | None = None) -> None:
        self.count += 1
        if len(self.shown) < SHOWN_LINE_ERRORS:
            self.shown.append(line_error(code, message, line, param))

    def listed(self) -> list[dict[str, Any]]:
        """The ones shown, then one entry counting those that are not."""
        if self.count <= len(self.shown):
            return list(self.shown)
        more = line_error(
            "invalid_request",
            f"{self.count - len(self.shown):,} more invalid lines are not listed; fix those above "
            "and validate again",
        )
        return [*self.shown, more]


def check_line(
    raw: bytes,
    number: int,
    gateway: Gateway,
    found: Validation,
    faults: LineFaults,
    seen_ids: set[str],
) -> None:
    """One request line (``number`` from 1 over the file): its form and its ``custom_id``'s
    uniqueness (faults of the file), then its request as the online endpoint checks it
    (refused on its own); counted in ``found``."""
    request_number = found.lines  # from 0, blank lines not counted
    found.lines += 1
    try:
        custom_id, body = read_envelope(raw, gateway)
    except APIError as error:
        faults.add(error.code or "invalid_request", error.message, number, error.param)
        return
    if custom_id in seen_ids:
        faults.add(
            "duplicate_custom_id",
            f"custom_id {custom_id!r} is used twice; each request needs its own",
            number,
            "custom_id",
        )
    seen_ids.add(custom_id)
    try:
        line = read_request(custom_id, body, gateway, validating=True)
    except APIError:  # answered on its own, in the error file; the batch goes on
        found.refused.add(request_number)
        return
    found.inputs += len(line.inputs)


def cap_errors(found: Validation, settings: Settings) -> list[dict[str, Any]]:
    """The batch caps ``found`` is over (none, no lines, too many lines or inputs)."""
    caps: list[dict[str, Any]] = []
    if not found.lines:
        caps.append(line_error("empty_file", "the input file has no request lines"))
    if found.lines > settings.batch_max_lines:
        caps.append(
            line_error(
                "too_many_tasks",
                f"the batch has {found.lines:,} requests, over the {settings.batch_max_lines:,} "
                "one batch may hold (EMBEDFLEET_BATCH_MAX_LINES); split the file into several "
                "batches",
            )
        )
    if found.inputs > settings.batch_max_inputs:
        caps.append(
            line_error(
                "too_many_tasks",
                f"the batch has {found.inputs:,} embedding inputs, over the "
                f"{settings.batch_max_inputs:,} one batch may hold "
                "(EMBEDFLEET_BATCH_MAX_INPUTS); split the file into several batches",
            )
        )
    return caps
