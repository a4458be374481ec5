"""The documentation names only commands that exist, and its links lead somewhere.

Every `embedfleet <verb> [--flag]` written in the README, in docs/*.md or in the chart's README,
in a fenced code block or in inline code, is looked up in the click command tree of
``embedfleet.cli:main``: a verb, sub-verb or flag the command line does not have fails the test
with the file and line. Relative links must reach a file, and a ``#fragment`` a heading of it.
The README must open with the Makefile's two commands and link a page per goal.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import click
import pytest

from embedfleet.cli import main
from tests.paths import REPO_ROOT

REPO = REPO_ROOT
README = REPO / "README.md"
GOAL_PAGES = ("docs/LAPTOP.md", "docs/INGESTION.md", "docs/KUBERNETES.md")


def documentation_files() -> list[Path]:
    return [README, *sorted((REPO / "docs").glob("*.md")), REPO / "helm/embedfleet/README.md"]


# --- reading commands out of Markdown ----------------------------------------------------------
FENCE = re.compile(r"^\s*(```|~~~)")
# a code span: a run of backticks, then up to the next run of exactly as many
INLINE_CODE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
TABLE_CELL = re.compile(r"(?<!\\)\|")
# Tokens that may stand before the command word of a shell segment.
PREFIX_WORDS = {"$", "sudo", "time", "nohup", "exec", "env", "command"}
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SHELL_OPERATORS = {"|", "||", "&", "&&", ";", ";;", "(", ")", "<", ">", ">>", "2>", "$("}
# A placeholder where a verb would be (`embedfleet VERB`, `embedfleet <verb>`): nothing to check.
PLACEHOLDER = re.compile(r"^(<[^>]*>|[A-Z][A-Z0-9_.]*)$")
ALTERNATIVE = "\x00"  # `list|show` written in a table: one of these verbs, not a pipe


@dataclass(frozen=True)
class Snippet:
    """A piece of code in a document: a fenced block's line or an inline code span."""

    path: Path
    line: int
    code: str
    runnable: bool = False  # a line of a fenced block: a command as one would run it

    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def snippets(path: Path, text: str | None = None) -> list[Snippet]:
    """Each line of each fenced code block, and each inline code span outside them, in the
    order they come in the document."""
    found = list(_snippets(path, path.read_text() if text is None else text))
    return sorted(found, key=lambda snippet: snippet.line)


def _snippets(path: Path, text: str) -> Iterator[Snippet]:
    block: list[tuple[int, str]] | None = None  # the fenced block being read
    prose: list[tuple[int, str]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            if block is None:
                block = []
                continue
            # a block that shows a session (`$ embedfleet status` and what it printed): only
            # its prompt lines are commands
            prompted = [(n, code[2:]) for n, code in block if code.startswith("$ ")]
            for n, code in prompted or block:
                yield Snippet(path, n, code, runnable=True)
            block = None
        elif block is not None:
            block.append((number, line))
        elif line.lstrip().startswith("|"):
            # a table row: GitHub splits it into cells before it looks for code spans
            for cell in TABLE_CELL.split(line):
                for match in INLINE_CODE.finditer(cell):
                    yield Snippet(path, number, " ".join(match.group(2).split()))
            prose.append((number, ""))
        else:
            prose.append((number, line))
    # inline code may wrap over a line break: search the prose joined, map offsets to lines
    joined, starts, offset = "", [], 0
    for number, line in prose:
        starts.append((offset, number))
        joined += line + "\n"
        offset += len(line) + 1
    for match in INLINE_CODE.finditer(joined):
        line = max(number for start, number in starts if start <= match.start())
        yield Snippet(path, line, " ".join(match.group(2).split()))


def command_lines(code: str) -> Iterator[list[str]]:
    """The words of every `embedfleet ...` command in one line of shell (or inline code)."""
    code = code.replace("\\|", "|")  # a pipe escaped in a Markdown table
    code = re.sub(r"(?<=\S)\|(?=\S)", ALTERNATIVE, code)  # `a|b` alternatives, not pipes
    code = re.sub(r"(^|\s)#.*$", "", code)  # a shell comment
    lexer = shlex.shlex(code, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # an unbalanced quote in prose-like code: split on spaces
        tokens = code.split()
    segment: list[str] = []
    for token in [*tokens, ";"]:
        if token in SHELL_OPERATORS or set(token) <= set("|&;()<>"):
            yield from _embedfleet_command(segment)
            segment = []
        else:
            segment.append(token)


def _embedfleet_command(segment: list[str]) -> Iterator[list[str]]:
    for index, token in enumerate(segment):
        is_command_word = token == "embedfleet" or token.endswith("/bin/embedfleet")
        if is_command_word and (
            all(ENV_ASSIGNMENT.match(t) or t in PREFIX_WORDS for t in segment[:index])
            or segment[index - 1] == "--"  # kubectl exec POD -- embedfleet status
        ):
            words = [t.strip("[]") for t in segment[index + 1 :]]
            yield [w for w in words if w]
            return


# --- checking them against the click tree ------------------------------------------------------
HELP_FLAGS = frozenset(main.context_settings.get("help_option_names", ["--help"]))


def is_flag(word: str) -> bool:
    return word.startswith("-") and word != "-" and not re.match(r"^-\d", word)


def check_command(words: list[str], *, runnable: bool = False) -> list[str]:
    """What in ``embedfleet WORDS`` the command line does not have (empty: all of it exists).

    ``runnable`` (a command in a code block, not a verb named in prose): it must also give the
    options the verb requires."""
    problems: list[str] = []
    path = ["embedfleet"]
    commands: list[click.Command] = [main]
    position = 0
    while True:
        # the options of the command chosen so far, up to its sub-command
        groups = [c for c in commands if isinstance(c, click.Group)]
        while groups and position < len(words) and is_flag(words[position]):
            option = _check_flag(words[position], commands, path, problems)
            position += 1
            if option is not None and "=" not in words[position - 1]:
                position += _values_taken(option)
        if not groups or position >= len(words):
            break
        word = words[position]
        if PLACEHOLDER.match(word):
            return problems  # `embedfleet VERB`: a verb is not named
        chosen = []
        for name in word.split(ALTERNATIVE):
            found = [g.commands[name] for g in groups if name in g.commands]
            if not found:
                problems.append(f"`{' '.join(path)} {name}`: no such verb")
            chosen += found
        if not chosen:
            return problems
        path.append(word.replace(ALTERNATIVE, "|"))
        commands = chosen
        position += 1
    rest = words[position:]
    positionals: list[str] = []
    given: set[str] = set()
    while rest:
        word, rest = rest[0], rest[1:]
        if is_flag(word):
            option = _check_flag(word, commands, path, problems)
            if option is not None:
                given.add(option.name or "")
                if "=" not in word:
                    rest = rest[_values_taken(option) :]
        else:
            positionals.append(word)
    asks_help = any(word in HELP_FLAGS for word in words)
    if runnable and len(commands) == 1 and not asks_help:
        required = [p for p in commands[0].params if isinstance(p, click.Option) and p.required]
        problems += [
            f"`{' '.join(path)}`: {option.opts[-1]} is required"
            for option in required
            if option.name not in given
        ]
    taken = [_arguments_taken(command) for command in commands]
    most = None if None in taken else max(n for n in taken if n is not None)
    if most is not None and len(positionals) > most:
        problems.append(
            f"`{' '.join(path)} {positionals[most]}`: no such verb "
            f"(`{' '.join(path)}` takes {most} arguments)"
        )
    return problems


def _check_flag(
    word: str, commands: list[click.Command], path: list[str], problems: list[str]
) -> click.Option | None:
    """The option ``word`` names on one of ``commands`` (a problem noted when none has it)."""
    flag = word.split("=", 1)[0]
    for command in commands:
        for param in command.params:
            if isinstance(param, click.Option) and flag in (*param.opts, *param.secondary_opts):
                return param
    if flag not in HELP_FLAGS:
        problems.append(f"`{' '.join(path)} {flag}`: no such flag")
    return None


def _values_taken(option: click.Option) -> int:
    return 0 if option.is_flag or option.count else option.nargs


def _arguments_taken(command: click.Command) -> int | None:
    """How many positional words ``command`` accepts (None: any number)."""
    counts = [p.nargs for p in command.params if isinstance(p, click.Argument)]
    return None if any(n < 0 for n in counts) else sum(counts)


def stale_commands(path: Path, text: str | None = None) -> list[str]:
    found = []
    for snippet in snippets(path, text):
        for words in command_lines(snippet.code):
            problems = check_command(words, runnable=snippet.runnable)
            found += [f"{snippet.where()}: {problem}" for problem in problems]
    return found


def named_commands(path: Path) -> list[list[str]]:
    return [w for s in snippets(path) for w in command_lines(s.code)]


# --- the tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("path", documentation_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_command_and_flag_in_the_docs_exists(path: Path) -> None:
    problems = stale_commands(path)
    assert not problems, "the docs name commands the CLI does not have:\n" + "\n".join(problems)


def test_the_docs_name_commands_at_all() -> None:
    """The reader must find what it checks: every verb of the CLI is named somewhere."""
    named = {words[0] for path in documentation_files() for words in named_commands(path) if words}
    assert set(main.commands) <= named, f"verbs the docs never show: {set(main.commands) - named}"


STALE_EXAMPLE = """\
| `EMBEDFLEET_CALIBRATION_FILE` | `` | ranges (`embedfleet calibration show --json` writes them) |
| `EMBEDFLEET_TRUNCATE` | `true` | a row after an empty code cell |

```bash
export EMBEDFLEET_SINK=lancedb:///tmp/x
embedfleet status --bogus | jq .   # a flag that does not exist
EMBEDFLEET_LOG_LEVEL=debug embedfleet frobnicate
kubectl exec deploy/w -- embedfleet dead list --reason too_long --dry-run
embedfleet plan --chunks 1e9 --workers 8
embedfleet plan --help
```

| `embedfleet dead list\\|show\\|explode [--reason CODE]` | a table row |
"""


def test_stale_verbs_and_flags_are_found() -> None:
    problems = [p.split(": ", 1)[1] for p in stale_commands(README, STALE_EXAMPLE)]
    assert problems == [
        "`embedfleet calibration show`: no such verb (`embedfleet calibration` takes 0 arguments)",
        "`embedfleet status --bogus`: no such flag",
        "`embedfleet frobnicate`: no such verb",
        "`embedfleet dead list --dry-run`: no such flag",
        "`embedfleet plan`: --texts-per-second-per-worker is required",
        "`embedfleet dead explode`: no such verb",
    ]


def test_commands_that_exist_pass() -> None:
    text = """\
`embedfleet --verbose worker --replicas 2`, `embedfleet dead list|show|replay [--dry-run]`,
`embedfleet search "a b" --k 5 --json`, `embedfleet VERB --help`, `helm install embedfleet x`

```bash
embedfleet enqueue - --job=docs --wait < chunks.jsonl && embedfleet status --json | jq '.x | .y'
```

```
$ embedfleet status
embedfleet status  2026-11-29T22:44:36+00:00  redis redis://127.0.0.1:6379/0
```
"""
    assert stale_commands(README, text) == []
    assert [w[:2] for w in (w for s in snippets(README, text) for w in command_lines(s.code))] == [
        ["--verbose", "worker"],
        ["dead", "list\x00show\x00replay"],
        ["search", "a b"],
        ["VERB", "--help"],
        ["enqueue", "-"],
        ["status", "--json"],
        ["status"],
    ]


# --- links ---------------------------------------------------------------------------------
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    in_fence = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and (match := re.match(r"^#{1,6}\s+(.*?)\s*#*$", line)):
            anchor = github_anchor(match.group(1))
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            if count:
                seen[f"{anchor}-{count}"] = 1
    return set(seen)


def prose_of(path: Path) -> str:
    """The text outside code (fenced blocks and inline spans), where links are links."""
    kept, in_fence = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence:
            kept.append(line)
    return INLINE_CODE.sub("", "\n".join(kept))


@pytest.mark.parametrize("path", documentation_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_and_anchors_resolve(path: Path) -> None:
    broken = []
    for target in LINK.findall(prose_of(path)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # https:, mailto:
        file_part, _, fragment = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(f"{target}: no heading #{fragment} in {linked.relative_to(REPO)}")
    assert not broken, f"{path.relative_to(REPO)}:\n" + "\n".join(broken)


def test_a_broken_anchor_is_found(tmp_path: Path) -> None:
    page = tmp_path / "PAGE.md"
    page.write_text("# Page\n\n## `embedfleet status`\n\n[ok](#embedfleet-status) [bad](#status)\n")
    targets = LINK.findall(prose_of(page))
    assert targets == ["#embedfleet-status", "#status"]
    assert [t[1:] in anchors(page) for t in targets] == [True, False]


# --- the README as a front door ------------------------------------------------------------
def test_the_readme_opens_with_the_makefiles_two_commands() -> None:
    text = README.read_text()
    first_block = text.split("```")[1]
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()[1:] if line]
    assert commands == ["make demo", "make test"]
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^demo:.*\n\t\$\(VENV\)/bin/embedfleet demo$", makefile, re.M)
    assert re.search(r"^test:.*\n\t\$\(PY\) -m pytest", makefile, re.M)
    assert text.index("```") < text.index("\n## "), "the commands come before any section"


def test_the_readme_links_a_page_per_goal_and_the_chart() -> None:
    text = README.read_text()
    for page in (*GOAL_PAGES, "helm/embedfleet/README.md"):
        assert f"]({page})" in text, f"README does not link {page}"
    assert len(text.splitlines()) < 300, "the README is a front door: details go to docs/"


# --- the gateway's routes ------------------------------------------------------------------------
GATEWAY_PAGE = REPO / "docs" / "GATEWAY.md"


def test_gateway_page_lists_every_route_with_its_dialect() -> None:
    """docs/GATEWAY.md's "Routes by dialect" names every route of the registry
    (embedfleet/gateway/routes.py) under the dialect its router declares, and only those; each
    route also has a row in the page's route table."""
    pytest.importorskip("fastapi")  # the gateway's extra
    from embedfleet.gateway import routes
    from embedfleet.gateway.errors import ErrorDialect, router_dialect

    text = GATEWAY_PAGE.read_text()
    section = text.split("\n## Routes by dialect\n", 1)[1].split("\n## ", 1)[0]
    listed: dict[ErrorDialect, set[str]] = {}
    for dialect, label in ((ErrorDialect.openai, "OpenAI's"), (ErrorDialect.tei, "TEI's")):
        line = next(row for row in section.splitlines() if row.startswith(f"- **{label}**"))
        listed[dialect] = {span[1] for span in INLINE_CODE.findall(line)}
    served: dict[ErrorDialect, set[str]] = {dialect: set() for dialect in listed}
    for router in routes.ROUTERS:
        for route in router.routes:
            path = re.sub(r":\w+}", "}", route.path)  # {model_id:path} is written {model_id}
            for method in route.methods:
                served[router_dialect(router)].add(f"{method} {path}")
    assert listed == served
    table = text.split("| route | what |", 1)[1].split("\n\n", 1)[0]
    for path in {entry.split(" ", 1)[1] for entries in served.values() for entry in entries}:
        if path == "/":
            continue  # TEI's aliases of /health and /embed, named in their rows
        stem = path.split("/{", 1)[0]
        assert f" {stem}" in table or f"`{stem}" in table, f"{path}: no row in the route table"


def _grpc_calls_named(section: str, package: str) -> set[str]:
    """The ``package.Service/Method`` names a docs section writes in backticks."""
    return set(re.findall(rf"`({re.escape(package)}\.\w+/\w+)`", section))


def _grpc_calls_of(module: ModuleType) -> set[str]:
    """Every method of the services a ``*_pb2`` module defines, as grpcurl names them."""
    return {
        f"{service.full_name}/{method.name}"
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    }


def test_gateway_page_names_every_grpc_call_of_teis_proto() -> None:
    """docs/GATEWAY.md's gRPC section names every method of the vendored tei.proto's services
    (``tei.v1.Service/Method``, as grpcurl writes it), and only those, and the stream's bound
    as the server holds it."""
    pytest.importorskip("grpc")  # the gateway's extra
    from embedfleet.gateway.tei_grpc import tei_pb2
    from embedfleet.gateway.tei_grpc.server import STREAM_IN_FLIGHT

    section = GATEWAY_PAGE.read_text().split("\n## gRPC\n", 1)[1].split("\n## ", 1)[0]
    assert _grpc_calls_named(section, "tei.v1") == _grpc_calls_of(tei_pb2)
    assert f"up to {STREAM_IN_FLIGHT} at a time" in section


def test_gateway_page_names_every_call_of_the_fleets_proto() -> None:
    """docs/GATEWAY.md's part on embedfleet.v1 names each method of fleet.proto's service, and
    only those, and each output dtype of the protocol (the proto's Dtype enum)."""
    pytest.importorskip("grpc")  # the gateway's extra
    from embedfleet.gateway.fleet_grpc import fleet_pb2
    from embedfleet.shared.protocol import OUTPUT_DTYPES

    section = GATEWAY_PAGE.read_text().split("\n### The fleet's own API", 1)[1]
    section = section.split("\n## ", 1)[0]
    assert _grpc_calls_named(section, "embedfleet.v1") == _grpc_calls_of(fleet_pb2)
    for dtype in OUTPUT_DTYPES:
        assert f"`{dtype}`" in section, dtype
