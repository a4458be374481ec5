"""docs/GLOSSARY.md: one name per concept, each entry naming the module that owns it.

Every ``## term`` entry has an ``Owner:`` line whose modules (``embedfleet.…`` in backticks)
exist, so the glossary cannot point at a module that moved or went; "lane" has one entry, and no
term is defined twice. The names an entry retires ("Formerly ...") appear in no Python
identifier of the package's source, wire names excepted, nor in its comments, docstrings and
messages beyond the few ``PROSE_LEFT`` counts.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path

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


# --- retired names -------------------------------------------------------------------------
# the package's source folders (pyproject.toml's package-dir maps them under embedfleet.*)
SOURCE_FOLDERS = ("embedfleet", "shared", "workers", "producer")
# Identifiers that keep a retired name because they are a wire name the glossary says stays:
# each is user-facing, renaming it would change what users type or read.
WIRE_NAMES = {
    # the settings field behind EMBEDFLEET_CUDA_QUERY_LANE (the forward path's entry: "a
    # settings name that stays")
    "cuda_query_lane",
}
FORMERLY = re.compile(r"\bformerly\b(.*?)(?:\.\s|\.$|\)\.)", re.I | re.S | re.M)


def retired_names() -> tuple[set[tuple[str, ...]], set[str]]:
    """What the glossary's "Formerly ..." sentences retire: each quoted phrase as its words
    ("the query lane" -> ("query", "lane")), and each identifier they define in backticks
    (`Lane = Literal[...]` -> "Lane"). The bare "the lane" is left out: "lane" keeps one
    meaning, the model lane, and its own entry."""
    phrases: set[tuple[str, ...]] = set()
    identifiers: set[str] = set()
    for sentence in FORMERLY.findall(GLOSSARY.read_text()):
        for phrase in re.findall(r'"the ([^"]+)"', sentence):
            words = tuple(phrase.lower().split())
            if words != ("lane",):
                phrases.add(words)
        identifiers.update(re.findall(r"`(\w+)\s*=", sentence))
    return phrases, identifiers


def words_of(identifier: str) -> tuple[str, ...]:
    """An identifier's words, lower case: ``QUERY_LANE_TAG``, ``query_lane`` and
    ``QueryLaneTag`` all start with ("query", "lane")."""
    return tuple(w.lower() for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", identifier))


def uses_a_retired_name(
    identifier: str, phrases: set[tuple[str, ...]], identifiers: set[str]
) -> bool:
    if identifier in WIRE_NAMES:
        return False
    if identifier in identifiers:
        return True
    words = words_of(identifier)
    return any(
        words[i : i + len(phrase)] == phrase for phrase in phrases for i in range(len(words))
    )


def identifiers_in(source: str) -> Iterator[tuple[int, str]]:
    """(line, name) of every identifier of a module: class and function names, parameters,
    variables and attributes (defined or used), keyword arguments and import names."""
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            yield line, node.name
        elif isinstance(node, ast.Name):
            yield line, node.id
        elif isinstance(node, ast.Attribute):
            yield line, node.attr
        elif isinstance(node, ast.arg | ast.keyword) and node.arg:
            yield line, node.arg
        elif isinstance(node, ast.alias):
            yield line, node.asname or node.name.rsplit(".", 1)[-1]


def source_files() -> list[Path]:
    return sorted(
        path
        for folder in SOURCE_FOLDERS
        for path in (REPO_ROOT / folder).rglob("*.py")
        if not path.is_symlink()
    )


def test_the_glossary_retires_the_old_lanes() -> None:
    phrases, identifiers = retired_names()
    assert {("query", "lane"), ("bulk", "lane"), ("cuda", "query", "lane")} <= phrases
    assert "Lane" in identifiers


def test_no_identifier_uses_a_retired_name() -> None:
    phrases, identifiers = retired_names()
    files = source_files()
    assert len(files) > 100
    found = sorted(
        f"{path.relative_to(REPO_ROOT)}:{line} {name}"
        for path in files
        for line, name in identifiers_in(path.read_text())
        if uses_a_retired_name(name, phrases, identifiers)
    )
    assert not found, (
        "identifiers that use a name docs/GLOSSARY.md retired (use the entry's name, or list a "
        f"wire name that stays in WIRE_NAMES): {found}"
    )


def test_retired_names_are_found_in_every_kind_of_identifier() -> None:
    phrases, identifiers = {("query", "lane")}, {"Lane"}
    source = (
        "from x import Lane\n"
        "QUERY_LANE_TAG = 'q'\n"
        "class QueryLaneStage: ...\n"
        "def f(query_lane, lane): return keys.query_lane, g(query_lane=1)\n"
        "cuda_query_lane = 1\n"
        "bulk_lane = lane_keys = 2\n"
    )
    named = [n for _, n in identifiers_in(source) if uses_a_retired_name(n, phrases, identifiers)]
    assert sorted(set(named)) == ["Lane", "QUERY_LANE_TAG", "QueryLaneStage", "query_lane"]
    assert named.count("query_lane") == 3  # the parameter, the attribute, the keyword


# --- retired names in prose -----------------------------------------------------------------
# Comments, docstrings and messages that still say a retired phrase, by file, at most this many
# times: a wire text the glossary keeps (issue 55). A new one anywhere else fails.
PROSE_LEFT = {
    # the 429 message's "query lane" (clients may match it) and the comment that says so
    "embedfleet/gateway/embedder.py": 2,
}


def prose_pattern(phrases: set[tuple[str, ...]]) -> re.Pattern[str]:
    """A retired phrase in text: its words apart by spaces, line breaks, comment marks or a
    hyphen ("query lane", "query-lane", "query\\n    # lane"), not inside an identifier
    (``cuda_query_lane``, ``EMBEDFLEET_CUDA_QUERY_LANE``)."""
    # the longest first, so "the CUDA query lane" is one match, not a "query lane" in it
    alternatives = sorted((r"[\s#\"'-]+".join(phrase) for phrase in phrases), key=len, reverse=True)
    return re.compile(r"\b(?:" + "|".join(alternatives) + r")s?\b", re.I)


def test_prose_uses_no_retired_name() -> None:
    phrases, _ = retired_names()
    pattern = prose_pattern(phrases)
    found = {
        str(path.relative_to(REPO_ROOT)): len(pattern.findall(path.read_text()))
        for path in source_files()
    }
    over = {name: count for name, count in found.items() if count > PROSE_LEFT.get(name, 0)}
    assert not over, (
        "comments, docstrings or messages that use a name docs/GLOSSARY.md retired (say the "
        f"entry's name: the query stage, the priority streams, the bulk path): {over}"
    )


def test_retired_names_are_found_in_prose() -> None:
    pattern = prose_pattern({("query", "lane"), ("cuda", "query", "lane")})
    text = (
        "# the query lane; the CUDA query lane's graph; a query-lane bound; the query\n"
        "#   lane again; Query Lanes\n"
        "cuda_query_lane = settings.EMBEDFLEET_CUDA_QUERY_LANE  # an identifier: not prose\n"
    )
    assert [" ".join(re.findall(r"[a-z]+", m.lower())) for m in pattern.findall(text)] == [
        "query lane",
        "cuda query lane",
        "query lane",
        "query lane",
        "query lanes",
    ]
