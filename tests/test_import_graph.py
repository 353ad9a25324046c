"""The package's imports: no circles, and docs/architecture.md's "Packages" table says what
each top-level module imports. Lazy (function-level) and type-only imports count everywhere.

A circle makes a module's meaning depend on which side is imported first; the rule is that
backends import their package's base and the package face imports backends only when chosen.

The table's rule: a row's "depends on" cell lists exactly the other streamrl modules its module
or package imports, comma-separated, each named relative to ``streamrl`` (``buffer`` covers the
whole package, ``buffer.base`` only that module, and every such name must cover an import);
``—`` means none; a parenthesised note is free text; a name that is not a streamrl module is a
third-party package the code must import (third-party imports need not be listed).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from pathlib import Path

import streamrl

ROOT = Path(streamrl.__file__).parent
ARCHITECTURE = ROOT.parent / "docs" / "architecture.md"


def package_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``streamrl``."""
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(path: Path, modules: Mapping[str, Path]) -> set[str]:
    """What ``path`` imports (absolute imports): a streamrl import as the module that defines
    the name, any other as its dotted name."""

    def owner(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # ``from pkg import sub`` depends on the submodule, not on the package face.
            targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                       else node.module for a in node.names]
        else:
            continue
        found |= {owner(t) if _in_package(t) else t for t in targets}
    return found - {""}


def _in_package(name: str) -> bool:
    return name == "streamrl" or name.startswith("streamrl.")


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: {t for t in imports_of(path, modules) if _in_package(t)} - {name}
            for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def unit_imports() -> dict[str, dict[str, set[str]]]:
    """Top-level module or package (``config``, ``buffer``) -> what it imports from outside
    itself -> the files that import it."""
    modules = package_modules()
    out: dict[str, dict[str, set[str]]] = {}
    for name, path in modules.items():
        if name == "streamrl":
            continue
        unit = name.split(".")[1]
        imported = out.setdefault(unit, {})
        for target in imports_of(path, modules):
            if target != "streamrl" and not (_in_package(target) and
                                             target.split(".")[1] == unit):
                imported.setdefault(target, set()).add(str(path.relative_to(ROOT)))
    return out


def package_table(markdown: str) -> dict[str, list[str]]:
    """The "## Packages" table: the module of each row (its first cell's first name,
    ``config.py`` -> ``config``, ``buffer/`` -> ``buffer``) -> the names its last cell lists."""
    section = markdown.split("\n## Packages\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        first = re.match(r"\| `(\w+)(?:\.py|/)`", line)
        if first is None:
            continue
        cell = re.sub(r"\([^)]*\)", "", line.rstrip().rstrip("|").rpartition("|")[2]).strip()
        rows[first.group(1)] = [] if cell == "—" else [n.strip() for n in cell.split(",")]
    return rows


def table_errors(rows: Mapping[str, list[str]],
                 imports: Mapping[str, Mapping[str, set[str]]]) -> list[str]:
    """Each way the table's rows differ from what the code imports, one line per row."""
    errors = [f"no row for `{unit}` in the Packages table"
              for unit in sorted(imports.keys() - rows.keys())]
    errors += [f"row `{unit}` names no streamrl module"
               for unit in sorted(rows.keys() - imports.keys())]
    for unit in sorted(rows.keys() & imports.keys()):
        ours = {t: files for t, files in imports[unit].items() if _in_package(t)}
        theirs = {t.split(".")[0] for t in imports[unit] if not _in_package(t)}
        problems, covered = [], set()
        for name in rows[unit]:
            if not re.fullmatch(r"\w+(\.\w+)*", name):
                problems.append(f"{name!r} is not a module name")
                continue
            if name.split(".")[0] in imports:  # a streamrl module
                full = f"streamrl.{name}"
                hits = {t for t in ours if t == full or t.startswith(full + ".")}
                covered |= hits
            else:
                hits = {name} & theirs
            if not hits:
                problems.append(f"lists {name}, which nothing in it imports")
        problems += [f"imports {t.removeprefix('streamrl.')} ({', '.join(sorted(ours[t]))}), "
                     "not listed" for t in sorted(ours.keys() - covered)]
        if problems:
            errors.append(f"row `{unit}` lists {', '.join(rows[unit]) or '—'}: "
                          + "; ".join(problems))
    return errors


def test_no_import_circles() -> None:
    graph = import_graph()
    assert "streamrl.runtime.actors" in graph and "streamrl.weight_bus.base" in graph
    assert cycles(graph) == []


def test_the_check_sees_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_packages_table_lists_what_each_package_imports() -> None:
    rows = package_table(ARCHITECTURE.read_text())
    imports = unit_imports()
    assert {"errors", "buffer", "weight_bus", "controller"} <= rows.keys()
    errors = table_errors(rows, imports)
    assert not errors, ("docs/architecture.md, Packages table (\"depends on\" must list the "
                        "streamrl modules the code imports):\n" + "\n".join(errors))


def test_the_table_check_names_each_difference() -> None:
    table = ("intro\n## Packages\n\n| module | job | depends on |\n|---|---|---|\n"
             "| `a.py` | job | b (why), torch |\n| `b/` | job (x, y) | — |\n"
             "| `c/` | job | a, b.base, numpy, everything |\n## Next\n| `d.py` | x | a |\n")
    rows = package_table(table)
    assert rows == {"a": ["b", "torch"], "b": [], "c": ["a", "b.base", "numpy", "everything"]}
    imports = {
        "a": {"streamrl.b.base": {"a.py"}, "torch.nn": {"a.py"}},
        "b": {"streamrl.types": {"b/x.py"}},
        "c": {"streamrl.b": {"c/y.py"}, "streamrl.d": {"c/z.py"}},
        "d": {},
        "types": {},
    }
    assert table_errors(rows, imports) == [
        "no row for `d` in the Packages table",
        "no row for `types` in the Packages table",
        "row `b` lists —: imports types (b/x.py), not listed",
        "row `c` lists a, b.base, numpy, everything: lists a, which nothing in it imports; "
        "lists b.base, which nothing in it imports; lists numpy, which nothing in it imports; "
        "lists everything, which nothing in it imports; imports b (c/y.py), not listed; "
        "imports d (c/z.py), not listed",
    ]
