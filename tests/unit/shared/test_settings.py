"""Settings come from EMBEDFLEET_* variables, and docs/SETTINGS.md documents every one of them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from embedfleet.shared.keys import Keys
from embedfleet.shared.protocol import ChunkLimits
from embedfleet.shared.settings import (
    SETTINGS_BEGIN,
    SETTINGS_DOC,
    SETTINGS_END,
    Settings,
    replace_settings_table,
    settings_table,
)
from tests.paths import REPO_ROOT

REPO = REPO_ROOT


def test_settings_doc_table_is_current() -> None:
    text = (REPO / SETTINGS_DOC).read_text()
    assert f"{SETTINGS_BEGIN}\n{settings_table()}\n{SETTINGS_END}" in text, (
        f"{SETTINGS_DOC}'s settings table is stale: regenerate it with "
        "`python -m embedfleet.shared.settings --write` (from the repository root)"
    )


def test_the_readme_links_the_settings_reference() -> None:
    assert f"]({SETTINGS_DOC})" in (REPO / "README.md").read_text()


def test_write_replaces_only_the_generated_table() -> None:
    stale = f"# Settings\n\nintro\n{SETTINGS_BEGIN}\n| old |\n{SETTINGS_END}\n\noutro\n"
    fresh = replace_settings_table(stale)
    assert "| old |" not in fresh and settings_table() in fresh
    assert fresh.startswith("# Settings\n\nintro\n") and fresh.endswith("\n\noutro\n")


def test_environment_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBEDFLEET_NAMESPACE", "{tenant1}")
    monkeypatch.setenv("EMBEDFLEET_TOKEN_BUDGET", "2048")
    settings = Settings()
    assert settings.keys.ingest == "{tenant1}:ingest" and settings.token_budget == 2048
    assert settings.keys.job("j") == "{tenant1}:job:j"


def test_the_records_made_from_settings_take_the_settings_of_their_names() -> None:
    settings = Settings(
        namespace="ns", group="g", partitions=4, model_lane="m", max_text_chars=7, max_id_chars=9
    )
    assert settings.keys == Keys(namespace="ns", group="g", partitions=4, model_lane="m")
    assert settings.chunk_limits == ChunkLimits(max_text_chars=7, max_id_chars=9)
    assert Settings().chunk_limits == ChunkLimits()  # the settings' defaults are the record's


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


def test_readme_exit_codes_table_is_current() -> None:
    from embedfleet.shared.exit_codes import exit_codes_table

    assert exit_codes_table() in (REPO / "README.md").read_text(), (
        "README's exit codes are stale: regenerate them with "
        "`python -m embedfleet.shared.exit_codes --write`"
    )
