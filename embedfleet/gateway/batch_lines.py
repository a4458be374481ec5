"""A Batch API input file's request lines: each parsed and checked as the online endpoint
checks a request (``parse_line``), and the whole file against the batch caps
(``validate_file``, the validating step)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from embedfleet.gateway.errors import APIError
from embedfleet.gateway.files import bounded_lines
from embedfleet.gateway.inputs import check_context, check_dimensions, prepare
from embedfleet.gateway.openai_api import EmbeddingRequest
from embedfleet.gateway.state import Gateway

ENDPOINT = "/v1/embeddings"
SHOWN_LINE_ERRORS = 100  # errors.data entries a failed batch keeps (its object is in Redis)


@dataclass(frozen=True)
class BatchLine:
    custom_id: str
    texts: list[str]
    encoding_format: str
    dimensions: int | None


def parse_line(raw: bytes, gateway: Gateway, *, validating: bool = False) -> BatchLine:
    """One JSONL request line, validated as the online endpoint would; APIError says why not.
    The context check runs in the validating step only (``validating``): a line that passed it
    is never refused later, when the card may have become known."""
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
    try:
        body = EmbeddingRequest.model_validate(line.get("body"))
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(
            400, f"body.{where}: {first.get('msg')}", param="body", code="invalid_request"
        ) from None
    gateway.check_model(body.model, "body.model")
    card = gateway.known_card  # None before any worker published: the worker checks
    check_dimensions(body.dimensions, card)
    texts = prepare(body.input, gateway.tokenizer, gateway.settings, "body.input")
    if validating and card is not None and not body.truncate:  # as online: refused, not cut
        check_context(texts, gateway.tokenizer, card.max_length, "body.input")
    return BatchLine(custom_id, texts, body.encoding_format, body.dimensions)


def line_error(
    code: str, message: str, line: int | None = None, param: str | None = None
) -> dict[str, Any]:
    """One entry of a failed batch's ``errors.data`` (OpenAI's BatchError)."""
    return {"code": code, "message": message, "param": param, "line": line}


@dataclass
class Validation:
    """What the validating step found in an input file."""

    lines: int = 0
    inputs: int = 0
    errors: list[dict[str, Any]] | None = None


def validate_file(path: Path, gateway: Gateway) -> Validation:
    """Every request line of a batch input file checked, and the batch caps; blocking (run it
    in a thread). Line numbers count from 1 over the file as written, blank lines included."""
    settings = gateway.settings
    found = Validation()
    errors: list[dict[str, Any]] = []
    bad_lines = 0
    seen_ids: set[str] = set()
    with path.open("rb") as handle:
        # bounded: a line over the cap (a file stored before it was lowered) is never held
        for number, raw in enumerate(bounded_lines(handle, settings.batch_max_line_bytes), 1):
            if raw is None:
                found.lines += 1
                bad_lines += 1
                if len(errors) < SHOWN_LINE_ERRORS:
                    errors.append(
                        line_error(
                            "line_too_large",
                            f"the line is over {settings.batch_max_line_bytes:,} bytes "
                            "(EMBEDFLEET_BATCH_MAX_LINE_BYTES)",
                            number,
                        )
                    )
                continue
            if not raw.strip():
                continue
            found.lines += 1
            try:
                line = parse_line(raw, gateway, validating=True)
            except APIError as error:
                bad_lines += 1
                if len(errors) < SHOWN_LINE_ERRORS:
                    errors.append(
                        line_error(
                            error.code or "invalid_request", error.message, number, error.param
                        )
                    )
                continue
            found.inputs += len(line.texts)
            if line.custom_id in seen_ids:
                bad_lines += 1
                if len(errors) < SHOWN_LINE_ERRORS:
                    errors.append(
                        line_error(
                            "duplicate_custom_id",
                            f"custom_id {line.custom_id!r} is used twice; each request needs "
                            "its own",
                            number,
                            "custom_id",
                        )
                    )
            seen_ids.add(line.custom_id)
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
    if bad_lines > len(errors):
        errors.append(
            line_error(
                "invalid_request",
                f"{bad_lines - len(errors):,} more invalid lines are not listed; fix those above "
                "and validate again",
            )
        )
    if caps or errors:
        found.errors = caps + errors
    return found
