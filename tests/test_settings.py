"""Settings come from EMBEDFLEET_* variables, and the README documents every one of them."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from embedfleet.shared.settings import Settings, settings_table

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


def test_batching_auto_per_device_and_explicit_values_win() -> None:
    from embedfleet.shared.settings import AUTO_BATCHING

    auto = Settings()
    assert auto.batching("cpu") == AUTO_BATCHING["cpu"]
    assert auto.batching("cuda") == AUTO_BATCHING["cuda"]
    assert auto.batching("mps") == AUTO_BATCHING["cpu"]  # unknown devices get the CPU's
    assert AUTO_BATCHING["cuda"].token_budget > AUTO_BATCHING["cpu"].token_budget
    mixed = Settings(token_budget=8192).batching("cuda")
    assert (mixed.token_budget, mixed.max_batch) == (8192, AUTO_BATCHING["cuda"].max_batch)
    for field, bad in (("token_budget", 8), ("max_batch", 0), ("read_count", -2)):
        with pytest.raises(ValidationError, match="-1 \\(auto, per device\\) or at least"):
            Settings(**{field: bad})
