"""OpenAI's Batch API routes: /v1/files and /v1/batches."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Form, Request, UploadFile
from fastapi.responses import FileResponse
from pydantic import BaseModel

from embedfleet.gateway.batches import ENDPOINT, BatchRunner, BatchStore, new_batch, parse_line
from embedfleet.gateway.errors import APIError
from embedfleet.gateway.files import FileStore
from embedfleet.gateway.state import Gateway, GatewayDep

router = APIRouter()
SHOWN_LINE_ERRORS = 10


def files_of(request: Request) -> FileStore:
    return request.app.state.files


def batches_of(request: Request) -> BatchStore:
    return request.app.state.batches


def runner_of(request: Request) -> BatchRunner:
    return request.app.state.runner


FilesDep = Annotated[FileStore, Depends(files_of)]
StoreDep = Annotated[BatchStore, Depends(batches_of)]
RunnerDep = Annotated[BatchRunner, Depends(runner_of)]


@router.post("/v1/files")
async def upload_file(
    file: UploadFile,
    purpose: Annotated[str, Form()],
    gateway: GatewayDep,
    files: FilesDep,
) -> dict[str, Any]:
    if purpose != "batch":
        raise APIError(
            400, f"purpose {purpose!r} is not supported here; use purpose=batch", param="purpose"
        )
    temp = files.temp_path("upload")
    try:
        await asyncio.to_thread(_copy_and_validate, file, temp, gateway)
        stored = files.publish(temp, file.filename or "batch.jsonl", purpose)
    finally:
        temp.unlink(missing_ok=True)
    return stored.as_dict()


def _copy_and_validate(upload: UploadFile, temp: Path, gateway: Gateway) -> None:
    """Stream the upload to disk, validating each JSONL line; 400 with line numbers if bad."""
    settings = gateway.settings
    problems: list[str] = []
    seen_ids: set[str] = set()
    lines = size = 0
    upload.file.seek(0)
    with temp.open("wb") as out:
        for number, raw in enumerate(upload.file, start=1):
            size += len(raw)
            if size > settings.batch_max_file_bytes:
                raise APIError(
                    413,
                    f"the file is over {settings.batch_max_file_bytes:,} bytes "
                    "(EMBEDFLEET_BATCH_MAX_FILE_BYTES); split it into several batches",
                    param="file",
                )
            out.write(raw)
            if not raw.strip():
                continue
            lines += 1
            if lines > settings.batch_max_lines:
                raise APIError(
                    400,
                    f"more than {settings.batch_max_lines:,} requests in one file "
                    "(EMBEDFLEET_BATCH_MAX_LINES); split it into several batches",
                    param="file",
                )
            try:
                line = parse_line(raw, gateway)
            except APIError as error:
                problems.append(f"line {number}: {error.message}")
                continue
            if line.custom_id in seen_ids:
                problems.append(f"line {number}: custom_id {line.custom_id!r} is used twice")
            seen_ids.add(line.custom_id)
    if not lines:
        raise APIError(400, "the file has no request lines", param="file")
    if problems:
        shown = "; ".join(problems[:SHOWN_LINE_ERRORS])
        more = (
            f" (and {len(problems) - SHOWN_LINE_ERRORS} more)"
            if len(problems) > SHOWN_LINE_ERRORS
            else ""
        )
        raise APIError(
            400,
            f"{len(problems)} invalid lines: {shown}{more}",
            param="file",
            code="invalid_batch_file",
        )


@router.get("/v1/files")
async def list_files(files: FilesDep, purpose: str | None = None) -> dict[str, Any]:
    return {"object": "list", "data": [f.as_dict() for f in files.list(purpose)]}


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, files: FilesDep) -> dict[str, Any]:
    return files.get(file_id).as_dict()


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, files: FilesDep) -> FileResponse:
    stored = files.get(file_id)
    return FileResponse(
        files.data_path(file_id), media_type="application/jsonl", filename=stored.filename
    )


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, files: FilesDep) -> dict[str, Any]:
    files.delete(file_id)
    return {"id": file_id, "object": "file", "deleted": True}


class BatchRequest(BaseModel):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


@router.post("/v1/batches")
async def create_batch(
    body: BatchRequest,
    gateway: GatewayDep,
    files: FilesDep,
    store: StoreDep,
    runner: RunnerDep,
) -> dict[str, Any]:
    if body.endpoint != ENDPOINT:
        raise APIError(
            400, f"endpoint {body.endpoint!r} is not supported; use {ENDPOINT!r}", param="endpoint"
        )
    if body.completion_window != "24h":
        raise APIError(400, "completion_window must be '24h'", param="completion_window")
    stored = files.get(body.input_file_id)
    if stored.purpose != "batch":
        raise APIError(
            400, f"{stored.id} was not uploaded with purpose=batch", param="input_file_id"
        )
    lines = sum(1 for _ in files.lines(stored.id))
    batch = new_batch(stored.id, body.completion_window, body.metadata)
    await store.create(batch, lines)
    runner.wake.set()
    return batch


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, store: StoreDep) -> dict:
    return await store.get(batch_id)


@router.get("/v1/batches")
async def list_batches(
    store: StoreDep, after: str | None = None, limit: int = 20
) -> dict[str, Any]:
    if not 1 <= limit <= 100:
        raise APIError(400, "limit must be between 1 and 100", param="limit")
    batches, has_more = await store.page(after, limit)
    return {
        "object": "list",
        "data": batches,
        "first_id": batches[0]["id"] if batches else None,
        "last_id": batches[-1]["id"] if batches else None,
        "has_more": has_more,
    }


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, store: StoreDep, runner: RunnerDep) -> dict:
    batch = await store.request_cancel(batch_id)
    if batch["status"] in ("validating", "in_progress"):
        batch["status"] = "cancelling"
    runner.wake.set()
    return batch
