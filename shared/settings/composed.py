"""``Settings``: every section in one class, as every side of the fleet reads it.

Each section (a module of this package) owns its fields, their defaults, descriptions and
validators; ``Settings`` inherits them all, so ``settings.<name>``, ``EMBEDFLEET_<NAME>`` and
``Settings(<name>=...)`` reach every field whatever section holds it. What spans sections (the
keys, which need the queue's names and the model's lane; a Parquet shard's age against the
reclaim time) is here.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError, model_validator

from embedfleet.shared.keys import Keys
from embedfleet.shared.settings.batch_api import BatchApiSettings
from embedfleet.shared.settings.batching import BatchingSettings
from embedfleet.shared.settings.gateway import GatewaySettings
from embedfleet.shared.settings.inputs import InputSettings
from embedfleet.shared.settings.model import ModelSettings
from embedfleet.shared.settings.operations import OperationsSettings
from embedfleet.shared.settings.query_stage import QueryStageSettings
from embedfleet.shared.settings.queue import QueueSettings
from embedfleet.shared.settings.reliability import ReliabilitySettings
from embedfleet.shared.settings.section import ENV_PREFIX, Section
from embedfleet.shared.settings.sinks import SinkSettings
from embedfleet.shared.settings.tenants import TenantSettings
from embedfleet.shared.settings.vector_cache import VectorCacheSettings

# The sections in the order the settings table lists them.
SECTIONS: tuple[type[Section], ...] = (
    QueueSettings,
    ModelSettings,
    VectorCacheSettings,
    BatchingSettings,
    QueryStageSettings,
    ReliabilitySettings,
    TenantSettings,
    InputSettings,
    OperationsSettings,
    GatewaySettings,
    BatchApiSettings,
    SinkSettings,
)


# The bases are SECTIONS reversed: pydantic collects the fields of the last base first, so
# ``Settings.model_fields`` (and the order of a ValidationError's problems) follows SECTIONS.
class Settings(
    SinkSettings,
    BatchApiSettings,
    GatewaySettings,
    OperationsSettings,
    InputSettings,
    TenantSettings,
    ReliabilitySettings,
    QueryStageSettings,
    BatchingSettings,
    VectorCacheSettings,
    ModelSettings,
    QueueSettings,
):
    """embedfleet configuration; every field is also an ``EMBEDFLEET_<NAME>`` variable.

    Each field's docstring is its description (pydantic's ``use_attribute_docstrings``): the
    meaning column of the settings table in docs/SETTINGS.md, under its section's heading.
    """

    @model_validator(mode="after")
    def _shards_before_reclaim(self) -> Settings:
        # A Parquet shard's entries are acknowledged when it is written; until then they are
        # pending. The bound was set when the worker stopped renewing their leases once it had
        # handed them to the sink; it renews them now until they are acknowledged, also while
        # the store is down (issue 40), so an older shard is no longer claimed by another worker.
        # The bound is kept as it was: a shard is cut by half of the idle time.
        if not self.parquet_sink or self.parquet_shard_max_s * 1000 <= self.reclaim_idle_ms / 2:
            return self
        raise ValueError(
            f"EMBEDFLEET_PARQUET_SHARD_MAX_S={self.parquet_shard_max_s:g} is too long for "
            f"EMBEDFLEET_RECLAIM_IDLE_MS={self.reclaim_idle_ms}: a shard's entries stay pending "
            "until it is written, and other workers claim entries idle that long. Set "
            f"EMBEDFLEET_PARQUET_SHARD_MAX_S to at most {self.reclaim_idle_ms / 2000:g} or "
            f"EMBEDFLEET_RECLAIM_IDLE_MS to at least {self.parquet_shard_max_s * 2000:.0f}"
        )

    @property
    def keys(self) -> Keys:
        """The fleet's key set: its namespace, group, partitions and model lane."""
        return self.as_record(Keys)


class SettingsError(ValueError):
    """A setting has a bad value; the message names the variable and what is allowed."""


# Variables of the project's own test harness (tests/, the Makefile), read by the tests, not by
# a process's settings: no warning for them
HARNESS_PREFIX = f"{ENV_PREFIX}TEST_"
# the standard logger: a warning before configure_logging has run still reaches stderr (the
# last-resort handler), never stdout, where a verb may be writing its data
_log = logging.getLogger("embedfleet.settings")
_warned: set[str] = set()  # the variables this process has warned about (once each)
# how alike an unprefixed variable must be to a setting's unprefixed name to be taken as a guess
# at it (API_KEYS and API_KEY: 0.93); two words to be taken as one (KEY and KEYS: 0.86); and
# the weighed share of a guess's words a setting must hold to be named
ALIAS_CUTOFF = 0.85
WORD_CUTOFF = 0.8
SHARED_CUTOFF = 0.5


def variable_of(name: str) -> str:
    """The environment variable of the setting ``name``: ``EMBEDFLEET_<NAME>``, or the alias a
    field reads instead (TEI's ``API_KEY``)."""
    alias = Settings.model_fields[name].validation_alias
    return alias if isinstance(alias, str) else f"{ENV_PREFIX}{name.upper()}"


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One message per variable in ``environ`` that is no setting but reads as a guess at one
    (a misspelt or guessed name is otherwise ignored without a word), naming the closest
    setting: every ``EMBEDFLEET_*`` variable, and an unprefixed one a letter or so from a
    setting's own unprefixed name (``API_KEYS`` beside TEI's ``API_KEY``)."""
    known = [variable_of(name) for name in Settings.model_fields]
    # the hint is always one of the fleet's own names, never an alias: EMBEDFLEET_API_KEY's is
    # EMBEDFLEET_API_KEYS, the keys list, not TEI's single API_KEY
    prefixed = [name for name in known if name.startswith(ENV_PREFIX)]
    aliases = [name for name in known if not name.startswith(ENV_PREFIX)]
    messages = []
    for variable in sorted(environ):
        upper = variable.upper()  # pydantic-settings reads names in any case
        if upper in known or upper.startswith(HARNESS_PREFIX):
            continue
        if not upper.startswith(ENV_PREFIX) and not difflib.get_close_matches(
            upper, aliases, n=1, cutoff=ALIAS_CUTOFF
        ):
            continue  # another program's variable
        closest = _closest(upper, prefixed)
        hint = f"did you mean {closest}?" if closest else "no setting has a like name"
        messages.append(
            f"{variable} is set but is no embedfleet setting, and is ignored: {hint} "
            "(every setting: docs/SETTINGS.md)"
        )
    return messages


def _stem(name: str) -> str:
    return name.removeprefix(ENV_PREFIX)


@functools.cache  # a guess's words are compared with every setting's, twice
def _alike(word: str, other: str) -> bool:
    """Two words of names alike: the same, or a letter or so apart (KEY and KEYS)."""
    return difflib.SequenceMatcher(None, word, other).ratio() >= WORD_CUTOFF


def _closest(variable: str, known: list[str]) -> str | None:
    """The setting most like ``variable``: by the words the names share after the prefix
    (split at ``_``), each weighed by how few settings hold it, so that a guessed section word
    (GATEWAY, in dozens of settings) counts for little beside API and KEY
    (EMBEDFLEET_GATEWAY_API_KEY finds EMBEDFLEET_API_KEYS, not EMBEDFLEET_GATEWAY_PORT); ties
    go to the nearer spelling. A name whose words match nowhere well enough (a typo across a
    ``_``) falls back to difflib's ratio over the whole names, among those whose names after
    the prefix are alike too (the prefix alone makes any two look alike)."""
    words = {name: _stem(name).split("_") for name in known}
    guessed = _stem(variable).split("_")
    # a word held by many settings tells little about which one was meant
    weights = [
        1.0 / (1 + sum(any(_alike(word, theirs) for theirs in split) for split in words.values()))
        for word in guessed
    ]

    def shared(name: str) -> float:
        held = [any(_alike(word, theirs) for theirs in words[name]) for word in guessed]
        return sum(w for w, is_held in zip(weights, held, strict=True) if is_held) / sum(weights)

    def spelling(name: str) -> float:
        return difflib.SequenceMatcher(None, _stem(variable), _stem(name)).ratio()

    best = max(known, key=lambda name: (shared(name), spelling(name)))
    if shared(best) >= SHARED_CUTOFF:
        return best
    # an unprefixed guess (APIKEY) is compared as the setting it would be
    as_setting = f"{ENV_PREFIX}{_stem(variable)}"
    for candidate in difflib.get_close_matches(as_setting, known, n=5, cutoff=0.6):
        if spelling(candidate) >= 0.5:
            return candidate
    return None


def warn_unknown_variables(environ: Mapping[str, str] | None = None) -> None:
    """Warn, once per process and variable, about each unknown ``EMBEDFLEET_*`` variable."""
    for message in unknown_variables(os.environ if environ is None else environ):
        if message not in _warned:
            _warned.add(message)
            _log.warning(message)


def load_settings(**overrides: Any) -> Settings:
    """Settings from the environment, with bad values reported as EMBEDFLEET_* variables; an
    ``EMBEDFLEET_*`` variable that is no setting is warned about (``unknown_variables``)."""
    warn_unknown_variables()
    try:
        return Settings(**overrides)
    except ValidationError as error:
        problems = [
            (
                f"{ENV_PREFIX}{'_'.join(str(p) for p in item['loc']).upper()}: "
                if item["loc"]
                else ""
            )
            + item["msg"]
            for item in error.errors()
        ]
        raise SettingsError("bad settings:\n  " + "\n  ".join(problems)) from None
