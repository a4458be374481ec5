"""shared/records.py: a dataclass built without __init__ must hold its other defaults on the
class."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from embedfleet.shared.records import require_class_defaults


@dataclass(frozen=True)
class _Plain:
    name: str
    count: int = 0
    label: str | None = None


@dataclass(frozen=True)
class _Factory:
    name: str
    tags: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Required:
    name: str
    size: int


def test_fields_with_class_defaults_pass() -> None:
    require_class_defaults(_Plain, ("name",))
    made = object.__new__(_Plain)
    made.__dict__["name"] = "a"
    assert made == _Plain("a") and hash(made) == hash(_Plain("a"))


def test_a_default_factory_is_refused() -> None:
    with pytest.raises(TypeError, match=r"\['tags'\] have no default on the class"):
        require_class_defaults(_Factory, ("name",))
    require_class_defaults(_Factory, ("name", "tags"))  # set by the builder: fine


def test_a_field_with_no_default_left_out_is_refused() -> None:
    with pytest.raises(TypeError, match=r"\['size'\]"):
        require_class_defaults(_Required, ("name",))
    require_class_defaults(_Required, ("name", "size"))
