"""One click group for the command line: embedfleet/cli.py registers every verb, one line each,
and no other module of the package registers one or defines a group of top-level verbs."""

from __future__ import annotations

import re

import click

from embedfleet.cli import main
from tests.paths import REPO_ROOT

REGISTRATION = re.compile(r"^main\.add_command\((\w+)\)", re.M)
PACKAGE_DIRS = ("embedfleet", "shared", "producer", "workers")


def test_every_verb_is_registered_once_in_cli_py() -> None:
    registered = REGISTRATION.findall((REPO_ROOT / "embedfleet" / "cli.py").read_text())
    assert len(registered) == len(set(registered)), "a verb registered twice"
    assert len(registered) == len(main.commands), "one main.add_command line per verb"


def test_no_other_module_registers_a_verb() -> None:
    elsewhere = []
    seen = set()
    for folder in PACKAGE_DIRS:
        for path in (REPO_ROOT / folder).rglob("*.py"):
            real = path.resolve()
            if real in seen or real == (REPO_ROOT / "embedfleet" / "cli.py").resolve():
                continue
            seen.add(real)
            if ".add_command(" in real.read_text():
                elsewhere.append(str(path.relative_to(REPO_ROOT)))
    assert not elsewhere, f"verbs registered outside embedfleet/cli.py: {elsewhere}"


def every_command(group: click.Group, path: str = "embedfleet") -> list[tuple[str, click.Command]]:
    """Each verb and sub-verb of ``group``, with its command line."""
    found = []
    for name, command in group.commands.items():
        found.append((f"{path} {name}", command))
        if isinstance(command, click.Group):
            found.extend(every_command(command, f"{path} {name}"))
    return found


def test_each_verb_function_has_one_definition_in_the_package() -> None:
    sources = {}
    for folder in PACKAGE_DIRS:
        for path in (REPO_ROOT / folder).rglob("*.py"):
            sources.setdefault(path.resolve(), path.read_text())
    for verb, command in every_command(main):
        assert command.callback is not None
        definition = re.compile(rf"^(?:async )?def {command.callback.__name__}\(", re.M)
        homes = sum(len(definition.findall(text)) for text in sources.values())
        assert homes == 1, f"{verb}: {command.callback.__name__} is defined {homes} times"
