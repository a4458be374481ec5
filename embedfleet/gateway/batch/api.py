"""OpenAI's Batch API routes: /v1/files and /v1/batches.

Each route works for the caller's owner only (gateway/auth.py): another key's file or batch is
a 404, as a missing one, in every route (list, retrieve, content, delete, cancel, and a batch
created from another's file)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import Depends, Form, Request, UploadFile
from fastapi.responses import FileResponse
from pydantic import BaseModel

from embedfleet.gateway.batch.files import FileStore, bounded_lines
from embedfleet.gateway.batch.runner import (
    ENDPOINT,
    BatchRunner,
    BatchStore,
    batch_tenant,
    new_batch,
)
from embedfleet.gateway.errors import APIError, ErrorDialect, dialect_router, retry_later
from embedfleet.gateway.state import GatewayDep
from embedfleet.shared.settings import Settings

router = dialect_router(ErrorDialect.openai)
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


def owner_of(request: Request) -> str:
    """The caller's owner: its key was checked at the front door (app.py); here it is mapped
    to its owner (the same comparison, in constant time)."""
    return request.app.state.gateway.keys.check(request.headers.get("authorization"))


OwnerDep = Annotated[str, Depends(owner_of)]
FilesDep = Annotated[FileStore, Depends(files_of)]
StoreDep = Annotated[BatchStore, Depends(batches_of)]
RunnerDep = Annotated[BatchRunner, Depends(runner_of)]


@router.post("/v1/files")
async def upload_file(
    file: UploadFile,
    purpose: Annotated[str, Form()],
    gateway: GatewayDep,
    files: FilesDep,
    owner: OwnerDep,
    anchor: Annotated[str | None, Form(alias="expires_after[anchor]")] = None,
    seconds: Annotated[int | None, Form(alias="expires_after[seconds]")] = None,
) -> dict[str, Any]:
    """Store an upload as it is: its lines are checked when a batch uses it, as OpenAI does (a
    malformed line fails that batch with ``errors``; a request refused on its own is answered
    in the batch's error file, gateway/batch/lines.py); here only its size and its lines'
    lengths, which bound what checking one line holds in memory (400, nothing stored)."""
    if purpose != "batch":
        raise APIError(
            400, f"purpose {purpose!r} is not supported here; use purpose=batch", param="purpose"
        )
    expires_after_s = expiry_seconds(anchor, seconds, gateway.settings, "expires_after")
    with files.scratch("upload") as temp:
        settings = gateway.settings
        await asyncio.to_thread(
            _copy, file, temp, settings.batch_max_file_bytes, settings.batch_max_line_bytes
        )
        stored = files.publish(
            temp, file.filename or "batch.jsonl", purpose, expires_after_s, owner=owner
        )
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


def _copy(upload: UploadFile, temp: Path, max_bytes: int, max_line_bytes: int) -> None:
    """Stream the upload to disk, a block at a time; 400 past ``max_bytes`` or for a line
    (without its newline) over ``max_line_bytes``."""
    size = 0
    lines_before = 0  # newlines in the blocks before this one
    line_bytes = 0  # length so far of the line the last block ended in
    upload.file.seek(0)
    with temp.open("wb") as out:
        while block := upload.file.read(COPY_BLOCK):
            size += len(block)
            if size > max_bytes:
                raise APIError(
                    400,
                    f"the file is over {max_bytes:,} bytes (EMBEDFLEET_BATCH_MAX_FILE_BYTES); "
                    "split it into several batches",
                    param="file",
                    code="file_too_large",
                )
            pieces = block.split(b"\n")
            # the first piece continues the line the last block ended in
            lengths = [line_bytes + len(pieces[0]), *map(len, pieces[1:])]
            if max(lengths) > max_line_bytes:
                over = next(i for i, n in enumerate(lengths) if n > max_line_bytes)
                raise APIError(
                    400,
                    f"line {lines_before + over + 1:,} is over {max_line_bytes:,} bytes "
                    "(EMBEDFLEET_BATCH_MAX_LINE_BYTES); send fewer or shorter inputs per "
                    "request",
                    param="file",
                    code="line_too_large",
                )
            lines_before += len(pieces) - 1
            line_bytes = lengths[-1]
            out.write(block)


def _count_lines(path: Path, max_line_bytes: int) -> int:
    """Request lines (not blank) of an input file, none of them held whole past the cap."""
    with path.open("rb") as handle:
        return sum(1 for raw in bounded_lines(handle, max_line_bytes) if raw is None or raw.strip())


@router.get("/v1/files")
async def list_files(
    files: FilesDep,
    owner: OwnerDep,
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
        files.list, purpose, after=after, limit=limit, order=order, owner=owner
    )
    return {
        "object": "list",
        "data": [f.as_dict() for f in page],
        "first_id": page[0].id if page else None,
        "last_id": page[-1].id if page else None,
        "has_more": has_more,
    }


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, files: FilesDep, owner: OwnerDep) -> dict[str, Any]:
    return files.get(file_id, owner).as_dict()


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, files: FilesDep, owner: OwnerDep) -> FileResponse:
    stored = files.get(file_id, owner)
    return FileResponse(
        files.data_path(file_id), media_type="application/jsonl", filename=stored.filename
    )


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, files: FilesDep, owner: OwnerDep) -> dict[str, Any]:
    files.delete(file_id, owner)
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


async def refuse_full_tenant(store: BatchStore, settings: Settings, owner: str, job: str) -> None:
    """429 while the tenant the owner (or the batch's job) maps to holds its
    EMBEDFLEET_TENANT_MAX_BACKLOG entries (shared/tenants.py)."""
    tenant = batch_tenant(settings, owner, job)
    room = await store.producer.room_for(tenant)
    if room.full:
        raise retry_later(
            429,
            f"tenant {tenant!r} has {room.held:,} entries waiting, at its limit "
            f"(EMBEDFLEET_TENANT_MAX_BACKLOG: {room.limit:,}); retry after the Retry-After "
            "seconds",
            "tenant_backlog_full",
            settings.gateway_retry_after_s,
        )


@router.post("/v1/batches")
async def create_batch(
    body: BatchRequest,
    gateway: GatewayDep,
    files: FilesDep,
    store: StoreDep,
    runner: RunnerDep,
    owner: OwnerDep,
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
    stored = files.get(body.input_file_id, owner)  # another's file: 404, as a missing one
    if stored.purpose != "batch":
        raise APIError(
            400, f"{stored.id} was not uploaded with purpose=batch", param="input_file_id"
        )
    # the total shows at once; the lines themselves are checked in the validating step
    try:
        lines = await asyncio.to_thread(
            _count_lines, files.data_path(stored.id), settings.batch_max_line_bytes
        )
    except FileNotFoundError:  # deleted meanwhile
        files.get(stored.id, owner)  # the 404
        raise
    batch = new_batch(
        stored.id,
        body.completion_window,
        body.metadata,
        settings.batch_completion_window_s,
        gateway.served_name,
    )
    await refuse_full_tenant(store, settings, owner, batch["id"])
    limit = settings.batch_max_active_per_owner
    if not await store.create(batch, lines, owner, output_expiry_s, max_active=limit):
        raise retry_later(
            429,
            f"this API key already has {limit} batches running "
            "(EMBEDFLEET_BATCH_MAX_ACTIVE_PER_OWNER); wait for one to end or cancel one",
            "too_many_active_batches",
            settings.gateway_retry_after_s,
        )
    runner.wake.set()
    return batch


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, store: StoreDep, owner: OwnerDep) -> dict:
    return await store.get(batch_id, owner)


@router.get("/v1/batches")
async def list_batches(
    store: StoreDep, owner: OwnerDep, after: str | None = None, limit: int = 20
) -> dict[str, Any]:
    if not 1 <= limit <= 100:
        raise APIError(400, "limit must be between 1 and 100", param="limit")
    batches, has_more = await store.page(owner, after, limit)
    return {
        "object": "list",
        "data": batches,
        "first_id": batches[0]["id"] if batches else None,
        "last_id": batches[-1]["id"] if batches else None,
        "has_more": has_more,
    }


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, store: StoreDep, runner: RunnerDep, owner: OwnerDep) -> dict:
    batch = await store.request_cancel(batch_id, owner)
    if batch["status"] in ("validating", "in_progress"):
        batch["status"] = "cancelling"
    runner.wake.set()
    return batch
