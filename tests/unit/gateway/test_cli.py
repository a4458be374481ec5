"""`embedfleet serve`'s checks (embedfleet/gateway/cli.py): which addresses keep the gateway to
this machine, and the loud warning when it would answer anyone."""

from __future__ import annotations

from embedfleet.gateway.cli import is_loopback, open_gateway_warning
from embedfleet.shared.settings import Settings


def test_loopback_addresses_and_names() -> None:
    for host in ("127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost", "LOCALHOST"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.0.0.5", "example.com", "gateway"):
        assert not is_loopback(host), host


def test_an_open_gateway_is_warned_about_only_without_keys_off_loopback() -> None:
    said = open_gateway_warning("0.0.0.0", Settings())
    assert said is not None and said.startswith("NO API KEY: the gateway listens on 0.0.0.0")
    assert "EMBEDFLEET_API_KEYS" in said
    assert open_gateway_warning("127.0.0.1", Settings()) is None
    assert open_gateway_warning("0.0.0.0", Settings(api_keys="sk-1")) is None
