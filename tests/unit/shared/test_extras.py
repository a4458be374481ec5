"""Which optional parts are installed: shared/extras.py."""

from __future__ import annotations

from embedfleet.shared.extras import missing_modules


def test_a_present_module_is_not_missing() -> None:
    assert missing_modules(("json", "email.mime")) == []


def test_a_dotted_name_whose_parent_is_absent_is_missing_not_an_error() -> None:
    # the worker image has no `google` package; the gateway extra lists "google.protobuf"
    absent = "embedfleet_no_such_parent_package"
    assert missing_modules((f"{absent}.protobuf", "json", absent)) == [
        f"{absent}.protobuf",
        absent,
    ]
