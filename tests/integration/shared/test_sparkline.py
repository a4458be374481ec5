"""`embedfleet status --watch`: throughput and backlog over the last minutes as sparklines."""

from __future__ import annotations

import asyncio
import re
import signal

import redis.asyncio as aioredis

from embedfleet.ops.sparkline import ASCII_LEVELS, BLOCKS, Trend, levels_for, sparkline
from embedfleet.shared.settings import Settings
from tests.conftest import cli_env, start_cli


def test_sparkline_scales_to_the_highest_value() -> None:
    assert sparkline([0, 5, 10, None, 2.5]) == "▁▅█ ▃"
    assert sparkline([0, 0]) == "▁▁"  # all zero: the floor, not blanks
    assert sparkline([None, None]) == "  "
    assert sparkline([0, 10], ASCII_LEVELS) == "_#"
    assert levels_for("utf-8") == BLOCKS and levels_for("ascii") == ASCII_LEVELS


def _report(finished: int, backlog: int) -> dict:
    """The parts of a `status --json` report a trend reads."""
    return {
        "streams": {
            "ingest": {"group_exists": True, "entries_read": finished + 3, "pending": 3},
            "query": {"group_exists": False, "entries_read": None, "pending": 0},
        },
        "backlog": backlog,
    }


def test_trend_buckets_rate_and_backlog_over_the_window() -> None:
    trend = Trend(window_s=60, columns=6)  # 10 s per column
    # 10 entries/s for the first 40 s of the minute, then stalled; backlog draining by 10/s
    for second in range(0, 62, 2):
        done = 10 * min(second, 40)
        trend.add(1000.0 + second, _report(done, 600 - done))
    rates, backlogs = trend.series(now=1060.0)
    assert rates[:4] == [10.0] * 4 and rates[-1] == 0.0
    assert backlogs[0] is not None and backlogs[0] > backlogs[3] == 200.0
    lines = trend.lines(now=1060.0, levels=BLOCKS)
    assert "entries/s ████▁▁ now 0/s, peak 10/s" in lines[0]
    assert "backlog   " in lines[1] and "now 200, peak 500" in lines[1]


def test_a_group_created_again_is_no_rate_not_a_negative_one() -> None:
    trend = Trend(window_s=10, columns=5)
    trend.add(0.0, _report(100, 0))
    trend.add(2.0, _report(5, 0))  # the counter went back: the stream was recreated
    rates, _ = trend.series(now=2.0)
    assert rates[-1] is None


async def test_status_watch_draws_throughput_and_backlog(
    settings: Settings, client: aioredis.Redis
) -> None:
    keys = settings.keys
    await client.xgroup_create(keys.ingest, settings.group, id="0", mkstream=True)
    for number in range(50):
        await client.xadd(keys.ingest, {"m": f"chunk {number}"})
    env = cli_env(settings, PYTHONIOENCODING="utf-8")
    process = await start_cli(env, "status", "--watch", "--interval", "0.2")
    assert process.stdout is not None

    async def next_trend_line(pattern: str) -> str:
        while True:
            line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
            assert line, "status --watch ended"
            if re.search(pattern, line):
                return line

    try:
        assert "now 50, peak 50" in await next_trend_line(r"^\s+backlog ")
        # a worker's work, by hand: read 20 entries through the group and acknowledge them
        read = await client.xreadgroup(settings.group, "w", {keys.ingest: ">"}, count=20)
        ids = [entry_id for entry_id, _ in read[0][1]]
        await client.xack(keys.ingest, settings.group, *ids)
        await client.xdel(keys.ingest, *ids)
        line = await next_trend_line(r"entries/s .*peak [1-9]")
        assert re.search(f"[{BLOCKS[1:]}]", line), line  # a bar above the floor
        assert "now 30," in await next_trend_line(r"^\s+backlog ")
    finally:
        process.send_signal(signal.SIGINT)
        _, stderr = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, stderr.decode()
