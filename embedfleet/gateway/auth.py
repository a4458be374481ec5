"""API keys: ``Authorization: Bearer KEY``, checked against a list in constant time."""

from __future__ import annotations

import hmac
from pathlib import Path

from embedfleet.gateway.errors import APIError
from embedfleet.shared.settings import Settings

# Probes and scrapes come from the cluster itself, without a key: the gateway's own and TEI's
# public routes (GET / is TEI's health check; POST / embeds, and needs a key).
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/health", "/ping"})


def is_open(method: str, path: str) -> bool:
    return path in OPEN_PATHS or (path == "/" and method in ("GET", "HEAD"))


def load_api_keys(settings: Settings) -> list[bytes]:
    """Keys from EMBEDFLEET_API_KEYS (comma-separated) and EMBEDFLEET_API_KEYS_FILE (one a line).

    An empty list means the gateway is open (no key configured).
    """
    keys = [key.strip() for key in (settings.api_keys or "").split(",")]
    if settings.api_keys_file:
        path = Path(settings.api_keys_file)
        if not path.is_file():
            raise FileNotFoundError(
                f"EMBEDFLEET_API_KEYS_FILE={settings.api_keys_file!r} does not exist"
            )
        keys += [line.strip() for line in path.read_text().splitlines()]
    return [key.encode() for key in keys if key and not key.startswith("#")]


class KeyChecker:
    def __init__(self, keys: list[bytes]) -> None:
        self.keys = keys

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def check(self, authorization: str | None) -> None:
        """Raise 401 unless the header carries one of the keys.

        Every key is compared (hmac.compare_digest, constant time per comparison, no early exit
        over the list), so the time taken says nothing about which key came close.
        """
        if not self.keys:
            return
        scheme, _, presented = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise APIError(
                401,
                "missing API key: send it as `Authorization: Bearer KEY`",
                code="invalid_api_key",
            )
        candidate = presented.strip().encode()
        matched = False
        for key in self.keys:
            matched |= hmac.compare_digest(candidate, key)
        if not matched:
            raise APIError(
                401,
                "incorrect API key provided; use one of the gateway's keys "
                "(EMBEDFLEET_API_KEYS or EMBEDFLEET_API_KEYS_FILE)",
                code="invalid_api_key",
            )
