"""Redis's eviction policy: anything but noeviction lets a full Redis delete the fleet's keys.

Real redis-server processes with the policy under test; the worker is an `embedfleet worker`
process (its start-up is what is checked), status is the `embedfleet status` command.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest

from embedfleet.server import ServerProcess, isolated_settings, preferred_server_binary
from embedfleet.shared.eviction import check_eviction_policy
from embedfleet.shared.redis_conn import connect
from embedfleet.shared.settings import Settings
from tests import forks
from tests.conftest import WorkerLauncher, cli_env

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
pytestmark = pytest.mark.slow

WARNING = "redis may evict the fleet's keys"


@pytest.fixture(scope="module")
def evicting_server() -> Iterator[ServerProcess]:
    """A Redis that deletes any key at its maxmemory (allkeys-lru), as some services default."""
    extra = ["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"]
    with ServerProcess(preferred_server_binary(), extra_args=extra) as server:
        yield server


async def status_json(settings: Settings) -> dict:
    done = await asyncio.to_thread(
        forks.run,
        ["status", "--json", "--sample", "0"],
        text=True,
        timeout=120,
        env=cli_env(settings),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


async def test_a_worker_warns_at_start_naming_the_policy_and_the_fix(
    evicting_server: ServerProcess, tmp_path
) -> None:
    settings = isolated_settings(evicting_server.url)
    worker = WorkerLauncher(settings, lambda: None, tmp_path).process("evicting", settings)
    try:
        await worker.wait_for_log(WARNING)
        (line,) = [json.loads(x) for x in worker.log().splitlines() if WARNING in x]
    finally:
        worker.stop()
    assert line["level"] == "warning" and line["policy"] == "allkeys-lru"
    assert line["fix"] == "maxmemory-policy noeviction"
    assert "allkeys-lru" in line["detail"] and "maxmemory-policy noeviction" in line["detail"]


async def test_serve_warns_at_start_naming_the_policy_and_the_fix(
    evicting_server: ServerProcess, tmp_path
) -> None:
    """`embedfleet serve` holds reply lists and Batch API records in Redis: it checks too."""
    settings = isolated_settings(evicting_server.url)
    log_path = tmp_path / "serve.log"
    env = cli_env(
        settings,
        EMBEDFLEET_GATEWAY_PORT="0",
        EMBEDFLEET_LOG_FORMAT="json",
        EMBEDFLEET_FILES_DIR=str(tmp_path / "files"),
    )
    with log_path.open("wb") as log_file:
        serve = forks.popen(["serve"], env=env, stdout=log_file, stderr=log_file)
    try:
        async with asyncio.timeout(120):
            while WARNING not in log_path.read_text(errors="replace"):
                assert serve.poll() is None, log_path.read_text(errors="replace")
                await asyncio.sleep(0.05)  # the process's log line is the signal
    finally:
        serve.terminate()
        serve.wait(30)
    lines = log_path.read_text(errors="replace").splitlines()
    (line,) = [json.loads(x) for x in lines if WARNING in x]
    assert line["level"] == "warning" and line["policy"] == "allkeys-lru"
    assert line["fix"] == "maxmemory-policy noeviction"


async def test_status_reports_the_policy(
    evicting_server: ServerProcess, settings: Settings
) -> None:
    evicting = (await status_json(isolated_settings(evicting_server.url)))["eviction_policy"]
    assert (evicting["policy"], evicting["safe"]) == ("allkeys-lru", False)
    assert "set maxmemory-policy noeviction" in evicting["warning"]
    text = await asyncio.to_thread(
        forks.run,
        ["status", "--sample", "0"],
        text=True,
        timeout=120,
        env=cli_env(isolated_settings(evicting_server.url)),
    )
    assert "eviction    WARNING: Redis's maxmemory-policy is allkeys-lru" in text.stdout
    safe = (await status_json(settings))["eviction_policy"]  # the test server: noeviction
    assert (safe["policy"], safe["safe"], safe["warning"]) == ("noeviction", True, None)


async def test_config_disabled_falls_back_to_info_then_says_it_could_not_check(
    evicting_server: ServerProcess,
) -> None:
    """Managed services disable CONFIG (here: ACL users without it, and without INFO too)."""
    admin = connect(evicting_server.url)
    await admin.execute_command("ACL SETUSER noconfig on >pw ~* &* +@all -config")
    await admin.execute_command("ACL SETUSER blind on >pw ~* &* +@all -config -info")
    await admin.aclose()
    port = evicting_server.port
    noconfig = connect(f"redis://noconfig:pw@127.0.0.1:{port}/0")
    read = await check_eviction_policy(noconfig)
    await noconfig.aclose()
    assert read.policy == "allkeys-lru"  # from INFO memory

    blind_url = f"redis://blind:pw@127.0.0.1:{port}/0"
    blind = connect(blind_url)
    unknown = await check_eviction_policy(blind)
    await blind.aclose()
    assert unknown.policy is None and unknown.safe is None
    assert unknown.warning is not None and unknown.warning.startswith("could not check")
    assert "CONFIG GET" in unknown.warning and "maxmemory-policy noeviction" in unknown.warning
    reported = (await status_json(isolated_settings(blind_url)))["eviction_policy"]
    assert reported["policy"] is None and reported["warning"].startswith("could not check")
