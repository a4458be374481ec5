"""API keys: ``Authorization: Bearer KEY``, checked against a list in constant time; and the
owner each key stands for.

Every Batch API object (file, batch, output and error file) belongs to the owner of the key that
made it, and a key sees only its own owner's. The owner is a short keyed hash of the key (not the
key: records and Redis never hold a key), stable across restarts and replicas; with no key
configured, everything belongs to ``ANONYMOUS``.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from embedfleet.gateway.errors import APIError
from embedfleet.shared.settings import Settings

# Probes and scrapes come from the cluster itself, without a key: the gateway's own and TEI's
# public routes (GET / is TEI's health check; POST / embeds, and needs a key).
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/health", "/ping"})
ANONYMOUS = "anonymous"  # the owner of everything on a gateway without keys
# the hash's key: names this use of the hash, so an owner id is no plain digest of the API key
# that some other system might also store
_OWNER_DOMAIN = b"embedfleet.gateway.owner.v1"
OWNER_HEX = 24  # 96 bits: no two keys of a deployment share an owner


def owner_id(key: bytes) -> str:
    """The owner an API key stands for: stable, and the key cannot be read back from it."""
    return hmac.new(_OWNER_DOMAIN, key, hashlib.sha256).hexdigest()[:OWNER_HEX]


def is_open(method: str, path: str) -> bool:
    return path in OPEN_PATHS or (path == "/" and method in ("GET", "HEAD"))


def load_api_keys(settings: Settings) -> list[bytes]:
    """Keys from EMBEDFLEET_API_KEYS (comma-separated), EMBEDFLEET_API_KEYS_FILE (one a line)
    and TEI's API_KEY (one key, whole, as TEI compares it).

    An empty list means the gateway is open (no key configured).
    """
    keys = [key.strip() for key in (settings.api_keys or "").split(",")]
    if settings.tei_api_key:
        keys.append(settings.tei_api_key)
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
        self._owners = [owner_id(key) for key in keys]

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def check(self, authorization: str | None) -> str:
        """The owner of the key the header carries; 401 unless it carries one of the keys.

        Every key is compared (hmac.compare_digest, constant time per comparison, no early exit
        over the list), so the time taken says nothing about which key came close.
        """
        if not self.keys:
            return ANONYMOUS
        scheme, _, presented = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise APIError(
                401,
                "missing API key: send it as `Authorization: Bearer KEY`",
                code="invalid_api_key",
            )
        candidate = presented.strip().encode()
        matched: str | None = None
        for key, owner in zip(self.keys, self._owners, strict=True):
            if hmac.compare_digest(candidate, key):
                matched = owner
        if matched is None:
            raise APIError(
                401,
                "incorrect API key provided; use one of the gateway's keys "
                "(EMBEDFLEET_API_KEYS, EMBEDFLEET_API_KEYS_FILE or API_KEY)",
                code="invalid_api_key",
            )
        return matched
