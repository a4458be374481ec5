"""The shape of the code in figures (issue 41): not a gate, a reading to quote and compare.

    python -m tools.shape [--json]

Reads the installed package's source (``embedfleet/``, ``shared/``, ``producer/``,
``workers/``: each file once, by its own path, named as the wheel names it) with ``ast`` and prints:
- the largest classes and functions, in lines (a god class or a long function shows here);
- import cycles between the project's modules: strongly connected groups of the import graph,
  once with module-level imports only, once with every import (a cycle closed by an import
  inside a function is still a cycle a reader must hold in mind);
- the places a sink kind is listed: modules holding a literal (tuple, list, set, dict,
  ``Literal[...]``, ``in (...)``) that names two or more sink kinds. A new store must be added
  to each of them by hand, so the target is one.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from tools.import_root import package_dirs

# import name -> folder, as pyproject.toml's package-dir maps them
PACKAGES = package_dirs()
SINK_KINDS = frozenset({"redis", "lancedb", "pgvector", "qdrant", "qdrant-local", "parquet"})


@dataclass(frozen=True)
class Definition:
    kind: str  # "class" or "function"
    name: str  # module:Qualified.name
    lines: int


def modules() -> Iterator[tuple[str, Path]]:
    """(module name, file) for every source file, each file once."""
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join([package, *parts]), path


def definitions(module: str, tree: ast.Module) -> Iterator[Definition]:
    def walk(node: ast.AST, prefix: str) -> Iterator[Definition]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                name = f"{prefix}{child.name}"
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                yield Definition(kind, f"{module}:{name}", lines)
                yield from walk(child, f"{name}.")

    yield from walk(tree, "")


def imports(module: str, tree: ast.Module, *, every: bool) -> set[str]:
    """The project modules ``module`` imports (at module level only unless ``every``)."""
    nodes = ast.walk(tree) if every else iter(tree.body)
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # relative: from the module's package
                package = module.rsplit(".", node.level)[0]
                base = f"{package}.{node.module}"
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("embedfleet")}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of two or more modules (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
    return sorted(groups)


def sink_kind_listings(tree: ast.Module) -> int:
    """Literals in this module that name two or more sink kinds."""
    count = 0
    for node in ast.walk(tree):
        values: list[ast.expr | None]
        if isinstance(node, ast.Dict):
            values = list(node.keys)
        elif isinstance(node, ast.Tuple | ast.List | ast.Set):
            values = list(node.elts)
        else:
            continue
        named = {v.value for v in values if isinstance(v, ast.Constant)} & SINK_KINDS
        count += len(named) >= 2
    return count


def measure() -> dict:
    trees = {name: ast.parse(path.read_text(), str(path)) for name, path in modules()}
    defs = [d for name, tree in trees.items() for d in definitions(name, tree)]

    def resolve(target: str) -> str | None:
        while target and target not in trees:
            target = target.rpartition(".")[0]
        return target or None

    def graph(every: bool) -> dict[str, set[str]]:
        edges = {}
        for name, tree in trees.items():
            targets = {resolve(t) for t in imports(name, tree, every=every)}
            # a package's own __init__ is not a cycle with the modules it re-exports
            edges[name] = {t for t in targets if t and t != name and not name.startswith(t + ".")}
        return edges

    largest = sorted(defs, key=lambda d: d.lines, reverse=True)
    listings = {name: n for name, tree in trees.items() if (n := sink_kind_listings(tree))}
    return {
        "files": len(trees),
        "lines": sum(len(path.read_text().splitlines()) for _, path in modules()),
        "largest_classes": [asdict(d) for d in largest if d.kind == "class"][:5],
        "largest_functions": [asdict(d) for d in largest if d.kind == "function"][:5],
        "import_cycles_module_level": cycles(graph(every=False)),
        "import_cycles_every_import": cycles(graph(every=True)),
        "sink_kind_listed_in": listings,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    figures = measure()
    if args.json:
        json.dump(figures, sys.stdout, indent=2)
        print()
        return 0
    print(f"{figures['files']} files, {figures['lines']:,} lines")
    for kind in ("classes", "functions"):
        print(f"largest {kind}:")
        for d in figures[f"largest_{kind}"]:
            print(f"  {d['lines']:5d}  {d['name']}")
    for which in ("module_level", "every_import"):
        groups = figures[f"import_cycles_{which}"]
        print(f"import cycles ({which.replace('_', ' ')}): {len(groups)}")
        for group in groups:
            print(f"  {len(group)} modules: {' -> '.join(group)}")
    listed = figures["sink_kind_listed_in"]
    print(f"sink kinds listed in {len(listed)} modules ({sum(listed.values())} literals):")
    for name, count in sorted(listed.items()):
        print(f"  {name}: {count}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
