"""What every settings section shares: the ``EMBEDFLEET_`` prefix and how fields are read.

A section is a small pydantic-settings class holding one area's fields (their defaults,
descriptions and validators); ``Settings`` (``composed.py``) inherits every section, so a field is
still ``settings.<name>`` and ``EMBEDFLEET_<NAME>`` whatever section owns it. Each field's
docstring is its description (pydantic's ``use_attribute_docstrings``): the meaning column of the
settings table in docs/SETTINGS.md, where each section is one heading (its ``title``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from pydantic_settings import BaseSettings, SettingsConfigDict

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Record = TypeVar("Record", bound="DataclassInstance")

ENV_PREFIX = "EMBEDFLEET_"


class Section(BaseSettings):
    """One area's settings; on its own it reads the same variables ``Settings`` does."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="ignore", use_attribute_docstrings=True
    )

    # the section's heading in docs/SETTINGS.md
    title: ClassVar[str]

    def as_record(self, cls: type[Record]) -> Record:
        """A ``cls`` (a dataclass) made from these settings: each of its fields that a setting
        has the name of takes that setting's value, the others keep their defaults (how
        ``Settings.keys`` and ``chunk_limits`` are made)."""
        return cls(**{name: getattr(self, name) for name in _named_alike(type(self), cls)})


@functools.cache
def _named_alike(settings: type[Section], record: type[Any]) -> tuple[str, ...]:
    """The fields of the dataclass ``record`` that ``settings`` has by the same name."""
    return tuple(
        field.name
        for field in dataclasses.fields(record)
        if field.init and field.name in settings.model_fields
    )
