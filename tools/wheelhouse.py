"""The requirements of the project with some of its extras, read from pyproject.toml, one per
line: what `make wheelhouse` hands to ``pip wheel -r`` instead of ``'.[worker]'``.

Naming the project itself (``'.[worker]'``) made pip build it in this tree, so the wheelhouse
could not be made while the packaging tests build it too (two builds in one tree collide) and
`make test-full` made it alone before anything else; the project's own wheel was deleted after
anyway (the images build it from their sources). From the requirements alone nothing is built
here, and the wheelhouse is made beside the tests.

    python -m tools.wheelhouse worker          # dependencies + the worker extra
    python -m tools.wheelhouse gateway         # dependencies + the gateway extra (+ documents)
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def requirements(extras: list[str], pyproject: Path = PYPROJECT) -> list[str]:
    """The project's dependencies and those of ``extras``; an extra that names the project
    itself (``embedfleet[documents]``) is expanded in place. Unknown extras are an error."""
    project = tomllib.loads(pyproject.read_text())["project"]
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})
    found: list[str] = list(project.get("dependencies", []))
    seen: set[str] = set()
    own_name = canonicalize_name(project["name"])

    def add(extra: str) -> None:
        if extra in seen:
            return
        if extra not in optional:
            raise SystemExit(f"pyproject.toml has no extra {extra!r} (it has {sorted(optional)})")
        seen.add(extra)
        for line in optional[extra]:
            requirement = Requirement(line)
            if canonicalize_name(requirement.name) == own_name:
                for inner in sorted(requirement.extras):
                    add(inner)
            elif line not in found:
                found.append(line)

    for extra in extras:
        add(extra)
    return found


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1:])))
