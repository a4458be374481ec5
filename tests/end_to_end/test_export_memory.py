"""`embedfleet results --out` holds one page, not the job: its peak RSS does not grow with the
job (issue 28). Slow: a quarter of a million results written and exported twice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from embedfleet.server import isolated_settings
from tests.conftest import cli_env
from tests.end_to_end.test_drain import write_results

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
pytestmark = pytest.mark.slow

SMALL = 50_000
# EMBEDFLEET_TEST_EXPORT_RESULTS=1000000 for the million-result job (a few minutes,
# ~200 MB of Redis and of disk)
LARGE = int(os.environ.get("EMBEDFLEET_TEST_EXPORT_RESULTS", 200_000))
# what a job 4x the size may add to the export's peak RSS: the old export (every result held,
# then written) grew by 78 MB over these sizes
GROWTH_LIMIT_MB = 12


def export_peak_rss_mb(env: dict[str, str], out: Path, *flags: str) -> float:
    """Run `embedfleet results --out OUT` and return its own peak RSS (wait4's rusage)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "embedfleet.cli", "results", "--out", str(out), *flags],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    _, status, usage = os.wait4(process.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, process.stderr.read() if process.stderr else ""
    process.returncode = 0
    return usage.ru_maxrss / 1024  # kilobytes on Linux


@pytest.mark.parametrize(("suffix", "flags"), [(".jsonl", ()), (".npz", ("--consume",))])
async def test_export_peak_rss_does_not_grow_with_the_job(
    redis_server, client: aioredis.Redis, tmp_path: Path, suffix: str, flags: tuple[str, ...]
) -> None:
    peaks = {}
    for count in (SMALL, LARGE):
        settings = isolated_settings(redis_server.url)
        await write_results(client, settings.keys.results, 0, count)
        out = tmp_path / f"{count}{suffix}"
        peaks[count] = export_peak_rss_mb(cli_env(settings), out, *flags)
        assert out.stat().st_size > count * 64  # every vector is in the file
        if flags:
            assert await client.xlen(settings.keys.results) == 0
        await client.delete(settings.keys.results)
        out.unlink()
    print(f"peak RSS of results --out{suffix} {' '.join(flags)}: {peaks}")
    assert peaks[LARGE] - peaks[SMALL] < GROWTH_LIMIT_MB, peaks
