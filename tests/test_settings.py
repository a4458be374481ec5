"""Settings come from EMBEDFLEET_* variables, and the README documents every one of them."""

from __future__ import annotations

from pathlib import Path

import pytest
from embedfleet.shared.settings import Settings, settings_table
from pydantic import ValidationError

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_settings_table_is_current() -> None:
    assert settings_table() in README.read_text(), (
        "README's settings table is stale: regenerate it with "
        "`python -m embedfleet.shared.settings`"
    )


def test_environment_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBEDFLEET_NAMESPACE", "{tenant1}")
    monkeypatch.setenv("EMBEDFLEET_TOKEN_BUDGET", "2048")
    settings = Settings()
    assert settings.keys.ingest == "{tenant1}:ingest" and settings.token_budget == 2048
    assert settings.keys.job("j") == "{tenant1}:job:j"


def test_bad_values_are_refused_with_the_variable_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBEDFLEET_DTYPE", "int3")
    with pytest.raises(ValidationError, match="dtype"):
        Settings()
