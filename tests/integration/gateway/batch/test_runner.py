"""Two gateways of one namespace whose files folders are not shared (EMBEDFLEET_FILES_DIR on
different disks), with a real Redis server and no worker: the second one answers for a file the
first stored with the shared-folder requirement, not with "no such file", and its batch runner
leaves the first one's batch alone instead of failing it as "input file deleted or expired"."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from embedfleet.gateway.app import create_app
from embedfleet.gateway.auth import ANONYMOUS
from embedfleet.gateway.batch.runner import new_batch
from embedfleet.shared.settings import Settings

LINE = '{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"input": "hi"}}\n'


async def test_a_gateway_of_another_files_folder_says_so_and_leaves_the_batch(
    settings: Settings, tmp_path: Path
) -> None:
    first = create_app(settings.model_copy(update={"files_dir": str(tmp_path / "first")}))
    second = create_app(settings.model_copy(update={"files_dir": str(tmp_path / "second")}))
    upload = tmp_path / "upload.jsonl"
    upload.write_text(LINE)
    stored = first.state.files.publish(upload, "in.jsonl", "batch")
    batch = new_batch(stored.id, "24h", None, 3600, "all-MiniLM-L6-v2")
    try:
        assert await first.state.batches.create(batch, 1, ANONYMOUS)
        # the second gateway's runner takes its turn on the batch: not its file, not its batch
        await second.state.runner._with_lease(batch["id"])
        kept = await second.state.batches.get(batch["id"])
        assert kept["status"] == "validating" and kept["errors"] is None, kept
        # its routes (the lifespan is not needed for these: they read the folder only)
        http = TestClient(second)
        for answer in (
            http.get(f"/v1/files/{stored.id}"),
            http.get(f"/v1/files/{stored.id}/content"),
            http.post(
                "/v1/batches",
                json={"input_file_id": stored.id, "endpoint": "/v1/embeddings"},
            ),
        ):
            assert answer.status_code == 404, answer.text
            error = answer.json()["error"]
            assert error["code"] == "file_in_another_folder"
            assert "EMBEDFLEET_FILES_DIR" in error["message"]
            assert "share one files folder" in error["message"]
        # the first gateway has the file: its runner runs the batch
        await first.state.runner._with_lease(batch["id"])
        assert (await first.state.batches.get(batch["id"]))["status"] == "in_progress"
    finally:
        for app in (first, second):
            await app.state.gateway.client.aclose()
