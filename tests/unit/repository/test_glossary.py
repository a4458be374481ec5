"""docs/GLOSSARY.md: one name per concept, each entry naming the module that owns it.

Every ``## term`` entry has an ``Owner:`` line whose modules (``embedfleet.…`` in backticks)
exist, so the glossary cannot point at a module that moved or went; "lane" has one entry, and no
term is defined twice.
"""

from __future__ import annotations

import importlib.util
import re

from tests.paths import REPO_ROOT

GLOSSARY = REPO_ROOT / "docs" / "GLOSSARY.md"
MODULE = re.compile(r"`(embedfleet(?:\.\w+)*)`")


def entries() -> dict[str, str]:
    """Each ``## term`` heading with the text of its entry, in the order of the page."""
    found: dict[str, str] = {}
    term: str | None = None
    lines: list[str] = []
    for line in [*GLOSSARY.read_text().splitlines(), "## "]:
        if line.startswith("## "):
            if term is not None:
                assert term not in found, f"{term!r} is defined twice"
                found[term] = "\n".join(lines)
            term, lines = line[3:].strip(), []
        else:
            lines.append(line)
    return found


def owners(entry: str) -> list[str]:
    """The modules the ``Owner:`` paragraph of an entry names."""
    paragraph = re.search(r"^Owner:(.*?)(?:\n\n|\Z)", entry, re.M | re.S)
    return MODULE.findall(paragraph.group(1)) if paragraph else []


def test_every_term_names_an_owner_module_that_exists() -> None:
    terms = entries()
    assert len(terms) >= 10
    for term, entry in terms.items():
        modules = owners(entry)
        assert modules, f"glossary term {term!r} names no owner module (an 'Owner:' line)"
        for module in modules:
            assert importlib.util.find_spec(module) is not None, (
                f"glossary term {term!r}: its owner {module} does not exist"
            )


def test_lane_has_one_meaning() -> None:
    terms = entries()
    assert "lane" in terms
    assert [t for t in terms if "lane" in t.lower()] == ["lane"], "one entry for 'lane'"
    assert "model lane" in terms["lane"].lower()


def test_owners_reads_the_owner_paragraph_only() -> None:
    entry = (
        "Text naming `embedfleet.nowhere`.\n\n"
        "Owner: `embedfleet.shared.keys` (`Keys`);\nthen `embedfleet.cli`.\n\n"
        "Wire: `embedfleet.x`."
    )
    assert owners(entry) == ["embedfleet.shared.keys", "embedfleet.cli"]
