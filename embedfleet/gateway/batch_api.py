"""OpenAI's Batch API routes: /v1/files and /v1/batches."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Form, Request, UploadFile
from fastapi.responses import FileResponse
from pydantic import BaseModel

from embedfleet.gateway.batches import ENDPOINT, BatchRunner, BatchStore, new_batch
from embedfleet.gateway.errors import APIError
from embedfleet.gateway.files import FileStore
from embedfleet.gateway.state import GatewayDep
from embedfleet.shared.settings import Settings

router = APIRouter()
COMPLETION_WINDOW = "24h"  # OpenAI's only one; its length is EMBEDFLEET_BATCH_COMPLETION_WINDOW_S
MAX_EXPIRY_S = 30 * 24 * 3600  # OpenAI's longest expires_after
MAX_FILES_PAGE = 10_000  # OpenAI's largest (and default) files page
COPY_BLOCK = 1 << 20


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
    anchor: Annotated[str | None, Form(alias="expires_after[anchor]")] = None,
    seconds: Annotated[int | None, Form(alias="expires_after[seconds]")] = None,
) -> dict[str, Any]:
    """Store an upload as it is: its lines are checked when a batch uses it (a bad line fails
    that batch with ``errors``, as OpenAI does), only its size here."""
    if purpose != "batch":
        raise APIError(
            400, f"purpose {purpose!r} is not supported here; use purpose=batch", param="purpose"
        )
    expires_after_s = expiry_seconds(anchor, seconds, gateway.settings, "expires_after")
    with files.scratch("upload") as temp:
        await asyncio.to_thread(_copy, file, temp, gateway.settings.batch_max_file_bytes)
        stored = files.publish(temp, file.filename or "batch.jsonl", purpose, expires_after_s)
    return stored.as_dict()


def expiry_seconds(
    anchor: str | None, seconds: int | None, settings: Settings, param: str
) -> int | None:
    """OpenAI's ``expires_after`` ({anchor: created_at, seconds}) as seconds from creation;
    without one, EMBEDFLEET_FILES_DEFAULT_EXPIRY_S (None: kept until deleted)."""
    if anchor is None and seconds is None:
        return settings.files_default_expiry_s or None
    if anchor != "created_at":
        raise APIError(
            400, f"{param}.anchor must be 'created_at', not {anchor!r}", param=f"{param}.anchor"
        )
    low = settings.files_min_expiry_s
    if seconds is None or not low <= seconds <= MAX_EXPIRY_S:
        raise APIError(
            400,
            f"{param}.seconds must be between {low} (EMBEDFLEET_FILES_MIN_EXPIRY_S) and "
            f"{MAX_EXPIRY_S} (30 days), not {seconds}",
            param=f"{param}.seconds",
        )
    return seconds


def _copy(upload: UploadFile, temp: Path, max_bytes: int) -> None:
    """Stream the upload to disk; 413 past ``max_bytes``."""
    size = 0
    upload.file.seek(0)
    with temp.open("wb") as out:
        while block := upload.file.read(COPY_BLOCK):
            size += len(block)
            if size > max_bytes:
                raise APIError(
                    413,
                    f"the file is over {max_bytes:,} bytes (EMBEDFLEET_BATCH_MAX_FILE_BYTES); "
                    "split it into several batches",
                    param="file",
                )
            out.write(block)


@router.get("/v1/files")
async def list_files(
    files: FilesDep,
    purpose: str | None = None,
    after: str | None = None,
    limit: int = MAX_FILES_PAGE,
    order: Literal["asc", "desc"] = "desc",
) -> dict[str, Any]:
    """A page of files, newest first by default; ``after`` (the last id of a page) gives the
    next, as the SDK's cursor pages ask."""
    if not 1 <= limit <= MAX_FILES_PAGE:
        raise APIError(400, f"limit must be between 1 and {MAX_FILES_PAGE}", param="limit")
    page, has_more = await asyncio.to_thread(
        files.list, purpose, after=after, limit=limit, order=order
    )
    return {
        "object": "list",
        "data": [f.as_dict() for f in page],
        "first_id": page[0].id if page else None,
        "last_id": page[-1].id if page else None,
        "has_more": has_more,
    }


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


class ExpiresAfter(BaseModel):
    anchor: str
    seconds: int


class BatchRequest(BaseModel):
    input_file_id: str
    endpoint: str
    completion_window: str = COMPLETION_WINDOW
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None


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
    if body.completion_window != COMPLETION_WINDOW:
        raise APIError(
            400, f"completion_window must be {COMPLETION_WINDOW!r}", param="completion_window"
        )
    settings = gateway.settings
    output_expiry = body.output_expires_after
    output_expiry_s = (
        expiry_seconds(
            output_expiry.anchor, output_expiry.seconds, settings, "output_expires_after"
        )
        if output_expiry
        else None
    )
    stored = files.get(body.input_file_id)
    if stored.purpose != "batch":
        raise APIError(
            400, f"{stored.id} was not uploaded with purpose=batch", param="input_file_id"
        )
    # the total shows at once; the lines themselves are checked in the validating step
    try:
        lines = await asyncio.to_thread(lambda: sum(1 for _ in files.lines(stored.id)))
    except FileNotFoundError:  # deleted meanwhile
        files.get(stored.id)  # the 404
        raise
    batch = new_batch(
        stored.id, body.completion_window, body.metadata, settings.batch_completion_window_s
    )
    await store.create(batch, lines, output_expiry_s)
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
