"""The gateway's side of the fleet (embedfleet/gateway/embedder.py): what a caller is told
while no worker is alive."""

from __future__ import annotations

from embedfleet.gateway.embedder import WorkerHeartbeats
from embedfleet.shared.settings import Settings


def test_no_worker_names_the_wait_the_fix_and_the_key_to_check() -> None:
    settings = Settings(namespace="ns1", gateway_worker_idle_ms=15000)
    said = WorkerHeartbeats(None, settings).none_alive()  # type: ignore[arg-type]
    assert said.startswith("no embedding worker is running (no heartbeat in the last 15000 ms)")
    assert "`embedfleet worker`" in said
    assert said.endswith(f"ZRANGE {settings.keys.workers_alive} 0 -1 WITHSCORES")
    assert "ns1" in settings.keys.workers_alive
