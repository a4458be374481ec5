"""All settings, read from the environment (``EMBEDFLEET_*``) with pydantic-settings.

One module per section, each a small class with its fields, defaults, descriptions and
validators: ``queue`` (Redis, keys, partitions), ``model``, ``vector_cache``, ``batching``,
``query_stage`` (and the forward paths), ``reliability``, ``tenants``, ``inputs`` (limits and
documents), ``operations``, ``gateway``, ``batch_api`` and ``sinks``; ``section`` is what they
share (the prefix). ``composed`` joins them into ``Settings``, the one class every side reads,
with what spans sections. ``table`` generates the settings reference (docs/SETTINGS.md), one
heading per section (``python -m embedfleet.shared.settings --write``, run from the repository
root), and a test checks that the two agree, so the documentation cannot drift from the code.
"""

from __future__ import annotations

from embedfleet.shared.settings.batching import AUTO_BATCHING, BATCHING_MINIMUM, Batching
from embedfleet.shared.settings.composed import SECTIONS, Settings, SettingsError, load_settings
from embedfleet.shared.settings.model import PACKAGED_MODEL
from embedfleet.shared.settings.queue import parse_partition_set
from embedfleet.shared.settings.section import ENV_PREFIX
from embedfleet.shared.settings.table import (
    SETTINGS_BEGIN,
    SETTINGS_DOC,
    SETTINGS_END,
    replace_settings_table,
    settings_table,
)

__all__ = [
    "AUTO_BATCHING",
    "BATCHING_MINIMUM",
    "ENV_PREFIX",
    "PACKAGED_MODEL",
    "SECTIONS",
    "SETTINGS_BEGIN",
    "SETTINGS_DOC",
    "SETTINGS_END",
    "Batching",
    "Settings",
    "SettingsError",
    "load_settings",
    "parse_partition_set",
    "replace_settings_table",
    "settings_table",
]
