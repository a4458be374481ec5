"""The package as the wheel lays it out, for the tools that do not run import hooks (mypy).

    python -m tools.import_root          # builds build/import_root/ and prints its path
    python -m tools.import_root --mypy   # builds it and type-checks it: make lint

In the repository each file has one path: ``shared/``, ``producer/`` and ``workers/`` sit at
the top level, and pyproject.toml's package-dir installs them as ``embedfleet.shared`` and so
on (from a checkout on PYTHONPATH, embedfleet/__init__.py's finder does the same). mypy reads
files, not finders, so it checks a generated tree instead: ``build/import_root/embedfleet/``
holds a link to each entry of ``embedfleet/`` and one per package-dir folder (copies where the
file system has no symlinks). It is made afresh on each run (build/ is not tracked), and mypy's
report names the repository's own paths, not the generated ones.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMPORT_ROOT = ROOT / "build" / "import_root"  # pyproject.toml's [tool.mypy] mypy_path


def package_dirs() -> dict[str, Path]:
    """Import name -> folder, as pyproject.toml's package-dir maps them for the wheel."""
    with (ROOT / "pyproject.toml").open("rb") as file:
        mapping = tomllib.load(file)["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in mapping.items()}


def build(target: Path = IMPORT_ROOT) -> dict[Path, Path]:
    """Lays the packages out under ``target``; returns each generated path -> the real one."""
    shutil.rmtree(target, ignore_errors=True)
    places: dict[Path, Path] = {}
    for name, folder in package_dirs().items():
        place = target.joinpath(*name.split("."))
        if place.parent == target:  # the root package: its entries, one link each
            place.mkdir(parents=True)
            for entry in sorted(folder.iterdir()):
                if entry.name != "__pycache__":
                    _link(place / entry.name, entry)
        else:
            _link(place, folder)
        places[place] = folder
    return places


def _link(place: Path, real: Path) -> None:
    try:
        place.symlink_to(os.path.relpath(real, place.parent), target_is_directory=real.is_dir())
    except OSError:  # no symlinks here (a Windows account without the privilege): a copy
        if real.is_dir():
            shutil.copytree(real, place, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(real, place)


def mypy(arguments: list[str]) -> int:
    """mypy over the import root (pyproject.toml's [tool.mypy]), its paths read as the real ones."""
    places = build()
    result = subprocess.run(
        [sys.executable, "-m", "mypy", *arguments],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    # the deepest generated path first: build/import_root/embedfleet/shared/ before .../embedfleet/
    renames = sorted(
        (
            (f"{place.relative_to(ROOT)}{os.sep}", f"{real.relative_to(ROOT)}{os.sep}")
            for place, real in places.items()
        ),
        key=lambda pair: -len(pair[0]),
    )
    for stream, text in ((sys.stdout, result.stdout), (sys.stderr, result.stderr)):
        for generated, real in renames:
            text = text.replace(generated, real)
        stream.write(text)
    return result.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mypy", action="store_true", help="type-check the package over it")
    options, rest = parser.parse_known_args(argv)
    if options.mypy:
        return mypy(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    build()
    print(IMPORT_ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
