"""Frozen dataclasses that a hot path builds without their ``__init__`` (issue 53).

A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``; where a GPU
host makes tens of thousands a second (a chunk, a delivery, a tokenized text), the builders set
the fields they have in the instance's ``__dict__`` and leave the others to be read from the
class, where a dataclass keeps each field's plain default. Equality, hashing, ``replace`` and
pickling read fields by name, so such an instance is the one ``__init__`` would make, as long as
every field the builder leaves out has its default on the class: :func:`require_class_defaults`
says so at import, or refuses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

_ABSENT = object()


def require_class_defaults(cls: type, built_with: Collection[str]) -> None:
    """Refuse (TypeError, at import) a dataclass a builder makes from ``built_with`` alone if
    one of its other fields has no default held on the class: none at all, or a
    ``default_factory`` (which ``__init__`` alone calls)."""
    missing = [
        field.name
        for field in dataclasses.fields(cls)
        if field.name not in built_with
        and (
            field.default is dataclasses.MISSING
            or getattr(cls, field.name, _ABSENT) is not field.default
        )
    ]
    if missing:
        raise TypeError(
            f"{cls.__name__} is built without __init__ from {sorted(built_with)}, but its "
            f"fields {missing} have no default on the class"
        )
