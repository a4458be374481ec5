"""Batch API settings: the gateway's OpenAI-style files and batches."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from embedfleet.shared.settings.section import Section


class BatchApiSettings(Section):
    """Where the Batch API keeps its files, the limits of a batch, its lease and its life."""

    title: ClassVar[str] = "Batch API and files"

    files_dir: str = "embedfleet-files"
    """Directory of the Batch API's files (uploads, outputs); a shared volume when the gateway has
    several replicas."""
    batch_max_lines: int = Field(default=50_000, ge=1)
    """Most requests in one batch (OpenAI's); a batch over it fails validation
    (`too_many_tasks`)."""
    batch_max_inputs: int = Field(default=50_000, ge=1)
    """Most embedding inputs over all requests of one batch (OpenAI's); a batch over it fails
    validation (`too_many_tasks`)."""
    batch_max_file_bytes: int = Field(default=200 * 1024 * 1024, ge=1024)
    """Largest batch input file (OpenAI's limit: 200 MB); a larger upload gets a 400
    (`file_too_large`; a declared body well over it, a 413 before it is read)."""
    batch_max_line_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    """Longest request line of a batch input file, in bytes; an upload with a longer line gets a
    400 (`line_too_large`) and is not stored. It bounds what the gateway holds to check one line
    (a line is parsed whole: 2,048 inputs of the longest text make about 200 MB)."""
    batch_max_active_per_owner: int = Field(default=100, ge=0)
    """Most batches one API key may have running (not yet completed, failed, expired or
    cancelled); one more gets a 429 (`too_many_active_batches`). `0`: no limit."""
    batch_lease_ms: int = Field(default=120_000, ge=100)
    """A gateway replica's lease on the batch it works on; renewed every third of it while the
    step runs, so another replica takes over only from one that stopped renewing (died, or lost
    Redis). A replica that lost its lease cannot end the batch: the end is fenced by its token."""
    batch_completion_window_s: int = Field(default=24 * 3600, ge=1)
    """How long a batch has to finish: the length of OpenAI's only `completion_window`, `24h`.
    A batch still running then ends `expired`: finished requests in its output file, the rest
    in its error file (`batch_expired`)."""
    files_default_expiry_s: int = Field(default=30 * 24 * 3600, ge=0)
    """Seconds until a file expires when its upload sets no `expires_after`, and until a batch's
    output and error files expire (OpenAI's default for batch files: 30 days). `0`: kept until
    deleted."""
    files_min_expiry_s: int = Field(default=3600, ge=1)
    """Shortest `expires_after.seconds` an upload may ask for (OpenAI's: 3600)."""
