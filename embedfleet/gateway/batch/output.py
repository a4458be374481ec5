"""A finished batch's output and error files (OpenAI's Batch API): written from its reply
lists and its input file, then published as its owner's files under the ids reserved in its
hash, while this replica's lease on it holds (gateway/batch/lease.py).

Memory: a batch's vectors wait on its reply lists in Redis; they are read REPLY_PAGE answers at
a time into a file on disk (a memory map), then the output is written one request line at a
time (gateway/batch/runner.py says what that bounds).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from embedfleet.gateway.batch.files import FileStore
from embedfleet.gateway.batch.lease import BatchLeases
from embedfleet.gateway.batch.lines import BatchLine, Refused, parse_line, read_envelope, refusal
from embedfleet.gateway.errors import APIError, ErrorDialect, input_rejected
from embedfleet.gateway.inputs import unit_vectors
from embedfleet.gateway.openai_api import embeddings_response
from embedfleet.gateway.state import Gateway
from embedfleet.producer.replies import Answers, ingest_reply_keys, read_answers
from embedfleet.shared.logging import get_logger

log = get_logger("embedfleet.gateway.batches")

REPLY_PAGE = 1000
Outcome = Literal["completed", "cancelled", "expired"]


def refused_record(custom_id: str, error: APIError) -> dict[str, Any]:
    """An error file line for a request refused on its own, in OpenAI's shape: the response the
    online endpoint would have given it (its status, OpenAI's error body), ``error`` null (that
    is for a request that got no response at all)."""
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {
            "status_code": error.status,
            "request_id": f"req_{uuid.uuid4().hex}",
            "body": ErrorDialect.openai.body(error),
        },
        "error": None,
    }


def batch_usage(input_tokens: int) -> dict[str, Any]:
    """OpenAI's Batch ``usage``: the tokens of the requests answered (``usage.prompt_tokens`` of
    the output file's lines, summed); an embedding model writes no output tokens."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens,
    }


class InputFileGone(Exception):
    """The batch's input file was deleted or expired: nothing more can be read or written."""


def input_path_of(files: FileStore, batch: dict) -> Path:
    """The batch's input file's data; InputFileGone once it was deleted or has expired."""
    if not files.exists(batch["input_file_id"]):
        raise InputFileGone(batch["input_file_id"])
    return files.data_path(batch["input_file_id"])


@dataclass(eq=False)
class BatchOutput:
    """Writes out the batches this replica finalizes (``finalize``), under their leases."""

    gateway: Gateway
    files: FileStore
    leases: BatchLeases

    def __post_init__(self) -> None:
        self.client = self.gateway.client
        self.keys = self.gateway.settings.keys

    @property
    def instance(self) -> str:
        """The replica writing (its leases' ``instance``)."""
        return self.leases.instance

    async def finalize(self, batch: dict, fields: dict[str, Any], outcome: Outcome) -> None:
        """Output and error files from the reply list; idempotent, so a restart redoes it.
        ``expired``: whatever has no result yet goes to the error file as ``batch_expired``."""
        batch_id = batch["id"]
        input_path = input_path_of(self.files, batch)
        total_inputs = fields["inputs"]
        # a worker answered if there are vectors: its card gives the rows' width (a line that
        # asked for fewer dimensions fills the start of its row)
        card = await self.gateway.model_card()
        output_id, error_id = await self._file_ids(batch_id)
        with self.files.scratch("vectors") as scratch:
            answers = Answers(
                total_inputs,
                # on disk, not in memory: a batch can be large
                lambda count, width, dtype: np.lib.format.open_memmap(
                    scratch, mode="w+", dtype="<f2", shape=(count, card.dim if card else width)
                ),
            )
            unreadable = await read_answers(
                self.client, ingest_reply_keys(self.keys, batch_id), answers, REPLY_PAGE
            )
            if unreadable:
                log.warning("bad replies in a batch", batch=batch_id, count=unreadable)
            failures = {index: str(error.reason) for index, error in answers.failures.items()}
            try:
                with (
                    self.files.scratch("output") as output_path,
                    self.files.scratch("errors") as error_path,
                ):
                    counts, input_tokens = await asyncio.to_thread(
                        self._write_files,
                        batch,
                        fields,
                        input_path,
                        answers.vectors,
                        answers.succeeded,
                        failures,
                        outcome,
                        output_path,
                        error_path,
                    )
                    # a replica whose lease expired while it wrote publishes nothing (and
                    # were it to, under the same ids: one file each still)
                    await self.leases.check(batch_id)
                    output, errors = await asyncio.to_thread(
                        self._publish,
                        batch,
                        fields,
                        output_path,
                        error_path,
                        (output_id, error_id if counts["failed"] else None),
                    )
            finally:
                answers.vectors = None  # the memmap's file is open until then
        batch["usage"] = batch_usage(input_tokens)
        await self.leases.end(batch, outcome, counts, output, errors)

    async def _file_ids(self, batch_id: str) -> tuple[str, str]:
        """The ids the batch's output and error files get, reserved in its hash on the first
        finalize, so that every finalize of the batch (a retry, another replica) uses them."""
        key = self.keys.batch(batch_id)
        pipe = self.client.pipeline(transaction=True)
        pipe.hsetnx(key, "output_id", self.files.new_id())
        pipe.hsetnx(key, "error_id", self.files.new_id())
        pipe.hmget(key, ["output_id", "error_id"])
        *_, (output_id, error_id) = await pipe.execute()
        return output_id.decode(), error_id.decode()

    def _publish(
        self,
        batch: dict,
        fields: dict[str, Any],
        output_path: Path,
        error_path: Path,
        ids: tuple[str, str | None],
    ) -> tuple[str, str | None]:
        """The written output (and error file, given its id) published under the reserved
        ids as the batch owner's files; their ids."""
        name = batch["id"]
        expiry = fields.get("output_expiry_s")
        expires_after_s = int(expiry) if expiry else self.gateway.settings.files_default_expiry_s
        keep = expires_after_s or None  # 0: kept until deleted
        output_id, error_id = ids
        owner = fields["owner"]
        self.files.publish(
            output_path,
            f"{name}_output.jsonl",
            "batch_output",
            keep,
            owner=owner,
            file_id=output_id,
        )
        if error_id is not None:
            self.files.publish(
                error_path,
                f"{name}_error.jsonl",
                "batch_output",
                keep,
                owner=owner,
                file_id=error_id,
            )
        return output_id, error_id

    def _write_files(
        self,
        batch: dict,
        fields: dict[str, Any],
        input_path: Path,
        vectors: np.ndarray | None,
        seen: np.ndarray,
        failures: dict[int, str],
        outcome: Outcome,
        output_path: Path,
        error_path: Path,
    ) -> tuple[dict[str, int], int]:
        """The output and error lines written to their temporary files; the request counts and
        the tokens of the requests answered (the batch's ``usage``). Every request line has one
        line in one of them: its vectors, the error it was refused with
        (``fields["refused"]``), or why it has no result."""
        gateway = self.gateway
        refused: Refused = fields["refused"]
        results = Results(vectors, seen, failures, outcome)
        completed = failed = input_tokens = 0
        first = 0  # the first input of the next request line sent: its row in ``vectors``
        with (
            output_path.open("w") as output,
            error_path.open("w") as errors,
            input_path.open("rb") as source,
        ):
            requests = (raw for raw in source if raw.strip())
            for number, raw in enumerate(requests):
                if number in refused:  # never sent, whatever the batch's outcome
                    custom_id, _ = read_envelope(raw, gateway)
                    answer = refused_record(custom_id, refusal(raw, gateway))
                    errors.write(json.dumps(answer) + "\n")
                    failed += 1
                    continue
                line = parse_line(raw, gateway, sent=True)
                sent = number < fields["cursor"]  # else cancelled or expired before it was sent
                span = range(first, first + len(line.inputs))
                if sent:
                    first += len(line.inputs)
                record, tokens = self._answer(line, span if sent else None, results)
                if tokens is None:
                    errors.write(json.dumps(record) + "\n")
                    failed += 1
                else:
                    output.write(json.dumps(record) + "\n")
                    completed += 1
                    input_tokens += tokens
        return {"total": fields["lines"], "completed": completed, "failed": failed}, input_tokens

    def _answer(
        self, line: BatchLine, span: range | None, results: Results
    ) -> tuple[dict[str, Any], int | None]:
        """A request line's record in the output or error file, and the tokens of its inputs
        when it has its vectors (None: it goes to the error file). ``span``: its inputs' rows
        in ``results``, None when it was never sent."""
        record: dict[str, Any] = {
            "id": f"batch_req_{uuid.uuid4().hex}",
            "custom_id": line.custom_id,
        }
        if span is None:
            return {**record, "response": None, "error": results.unsent_error()}, None
        missing = results.missing(span)
        if results.withdrawn(missing):
            return {**record, "response": None, "error": results.withdrawn_error()}, None
        request_id = f"req_{uuid.uuid4().hex}"
        if missing:  # answered as the online endpoint answers a dead letter
            error = input_rejected(results.failure_of(missing[0]))
            body = ErrorDialect.openai.body(error)
            response = {"status_code": error.status, "request_id": request_id, "body": body}
            return {**record, "response": response, "error": None}, None
        body, tokens = self._embeddings(line, span, results.vectors)
        response = {"status_code": 200, "request_id": request_id, "body": body}
        return {**record, "response": response, "error": None}, tokens

    def _embeddings(
        self, line: BatchLine, span: range, vectors: np.ndarray | None
    ) -> tuple[dict[str, Any], int]:
        """The line's vectors as the online endpoint answers them, and their tokens."""
        gateway = self.gateway
        card = gateway.known_card  # read in finalize, before the first vector
        assert card is not None and vectors is not None  # (else all were missing)
        block = vectors[span.start : span.stop, : line.dimensions or card.dim]
        block = unit_vectors(block, card.normalize)
        tokens = gateway.tokenizer.usage(line.texts, card.max_length)
        body = embeddings_response(gateway.served_name, block, line.encoding_format, tokens)
        return body, tokens


@dataclass(frozen=True)
class Results:
    """What a batch's workers answered, by input (its row): ``vectors`` and which of them came
    (``seen``), the reasons of those that failed (``failures``), and how the batch ended."""

    vectors: np.ndarray | None
    seen: np.ndarray
    failures: dict[int, str]
    outcome: Outcome

    @property
    def ended(self) -> str:
        """How an unfinished batch ended, as its error codes say (``batch_<ended>``)."""
        return "cancelled" if self.outcome == "cancelled" else "expired"

    def missing(self, span: range) -> list[int]:
        """The inputs of ``span`` with no vector."""
        return [i for i in span if self.vectors is None or not self.seen[i]]

    def withdrawn(self, missing: list[int]) -> bool:
        """Whether inputs are missing because the batch ended unfinished (its unfinished inputs
        withdrawn), rather than because they failed."""
        return (
            self.outcome != "completed"
            and bool(missing)
            and not any(i in self.failures for i in missing)
        )

    def failure_of(self, index: int) -> str:
        return self.failures.get(index, "no result (see the dead-letter stream)")

    def unsent_error(self) -> dict[str, Any]:
        """A request line the batch ended before sending."""
        return {
            "code": f"batch_{self.ended}",
            "message": f"the batch was {self.ended} before this request was sent",
        }

    def withdrawn_error(self) -> dict[str, Any]:
        """A request line sent but withdrawn unfinished: answered as one never sent."""
        return {
            "code": f"batch_{self.ended}",
            "message": "the batch's completion window ended before this "
            "request finished; send it again in a new batch"
            if self.outcome == "expired"
            else "the batch was cancelled before this request finished",
        }
