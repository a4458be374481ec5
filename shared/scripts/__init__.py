"""The fleet's Redis scripts, one ``.lua`` file each, and their one loader.

The scripts the whole fleet shares are in this folder; a part with scripts of its own keeps them
beside its modules and names its package (``load("end_batch", package=...)``: the Batch API's
in embedfleet/gateway/batch/), so its state changes are read where its code is.

Each file opens with a header that says what its ``KEYS`` and ``ARGV`` are; every state change
a script makes is in that one file (read it with ``redis-cli --eval`` in mind). Every key a
script touches is passed in ``KEYS``, so on Redis Cluster a call needs only its keys to share a
slot, which each partition's hash tag guarantees.

Callers send the text with EVAL, not EVALSHA: a batch goes out in one round trip, and a
restarted server (empty script cache) needs no SCRIPT LOAD first; Redis compiles a script once
and caches it by its digest.
"""

from __future__ import annotations

import functools
from importlib import resources


class ScriptError(RuntimeError):
    """A script file is missing or lacks its KEYS/ARGV header."""


@functools.cache
def load(name: str, package: str = __name__) -> str:
    """The text of ``<name>.lua`` in ``package``'s folder (this one unless told)."""
    try:
        text = resources.files(package).joinpath(f"{name}.lua").read_text(encoding="utf-8")
    except FileNotFoundError as error:
        raise ScriptError(f"no Redis script {name}.lua in {package}") from error
    header = [line for line in text.splitlines() if line.startswith("--")]
    if not any("KEYS" in line for line in header) or not any("ARGV" in line for line in header):
        raise ScriptError(f"{name}.lua must open with comments naming its KEYS and ARGV")
    return text


def names(package: str = __name__) -> list[str]:
    """Every script in ``package``'s folder (this one unless told), by name."""
    return sorted(
        entry.name.removesuffix(".lua")
        for entry in resources.files(package).iterdir()
        if entry.name.endswith(".lua")
    )
