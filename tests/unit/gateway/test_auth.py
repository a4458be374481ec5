"""The gateway's API keys (embedfleet/gateway/auth.py): read from the setting and a file,
checked on each request."""

from __future__ import annotations

from pathlib import Path

import pytest

from embedfleet.gateway.auth import KeyChecker, load_api_keys
from embedfleet.gateway.errors import APIError
from embedfleet.shared.settings import Settings


def test_keys_from_the_setting_and_a_file(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# rotated 2026-11\nsk-file-one\n\nsk-file-two\n")
    settings = Settings(api_keys=" sk-env ,", api_keys_file=str(keys_file))
    checker = KeyChecker(load_api_keys(settings))
    for key in ("sk-env", "sk-file-one", "sk-file-two"):
        checker.check(f"Bearer {key}")
    for header in (None, "", "Bearer", "Basic sk-env", "Bearer sk-env2", "Bearer sk-fil"):
        with pytest.raises(APIError) as caught:
            checker.check(header)
        assert caught.value.status == 401 and caught.value.code == "invalid_api_key"
    KeyChecker([]).check(None)  # no keys configured: open
    with pytest.raises(FileNotFoundError, match="EMBEDFLEET_API_KEYS_FILE"):
        load_api_keys(Settings(api_keys_file=str(tmp_path / "missing")))
