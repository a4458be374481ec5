"""What every settings section shares: the ``EMBEDFLEET_`` prefix and how fields are read.

A section is a small pydantic-settings class holding one area's fields (their defaults,
descriptions and validators); ``Settings`` (``composed.py``) inherits every section, so a field is
still ``settings.<name>`` and ``EMBEDFLEET_<NAME>`` whatever section owns it. Each field's
docstring is its description (pydantic's ``use_attribute_docstrings``): the meaning column of the
settings table in docs/SETTINGS.md, where each section is one heading (its ``title``).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "EMBEDFLEET_"


class Section(BaseSettings):
    """One area's settings; on its own it reads the same variables ``Settings`` does."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="ignore", use_attribute_docstrings=True
    )

    # the section's heading in docs/SETTINGS.md
    title: ClassVar[str]
