"""The tree's shape in numbers (issue 23's before/after): top-level backend modules, import cycles, deferred imports, lines.

    .venv/bin/python scripts/house_counts.py [ROOT]

Counts, over backend/ and console/ of ROOT (default: this checkout):
- top-level modules of backend/ (the .py files directly in it);
- import cycles between modules (strongly connected components of the module import graph, every import counted,
  function-local ones included) and between top-level folders (packages) of backend/ and console/;
- function-local imports of this project's own modules (an import statement inside a def);
- lines of backend/ + console/;
- README words.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGES = ("backend", "console")


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules(root: Path) -> dict[str, Path]:
    return {module_name(root, p): p for package in PACKAGES for p in (root / package).rglob("*.py")}


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module an imported dotted name lands in (a name imported from a package maps to the package)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(path: Path, modules: dict[str, Path]) -> tuple[set[str], int]:
    """(project modules imported anywhere in the file, function-local import statements of project modules)."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    deferred = 0
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [f"{node.module}.{alias.name}" for alias in node.names]
        hits = {hit for hit in (resolve(t, modules) for t in targets) if hit}
        found |= hits
        if hits and getattr(node, "_in_function", False):
            deferred += 1
        for child in ast.iter_child_nodes(node):
            child._in_function = getattr(node, "_in_function", False) or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))  # type: ignore[attr-defined]
    return found, deferred


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def folder_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else module


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else Path(__file__).resolve().parent.parent)
    modules = project_modules(root)
    graph: dict[str, set[str]] = {}
    deferred = 0
    for name, path in modules.items():
        found, local = imports_of(path, modules)
        graph[name] = {m for m in found if m != name and not name.startswith(m + ".")}  # a package's own __init__ is no edge
        deferred += local
    folders: dict[str, set[str]] = {}
    for name, targets in graph.items():
        folders.setdefault(folder_of(name), set()).update(folder_of(t) for t in targets if folder_of(t) != folder_of(name))
    lines = sum(len(p.read_text().splitlines()) for p in modules.values())
    readme = root / "README.md"
    print(f"top-level modules of backend/: {len(list((root / 'backend').glob('*.py')))}")
    module_cycles, folder_cycles = cycles(graph), cycles(folders)
    print(f"module import cycles: {len(module_cycles)}")
    for cycle in module_cycles:
        print(f"  {' <-> '.join(cycle)}")
    print(f"folder import cycles: {len(folder_cycles)}")
    for cycle in folder_cycles:
        print(f"  {' <-> '.join(cycle)}")
    print(f"function-local imports of project modules: {deferred}")
    print(f"lines of backend/ + console/: {lines}")
    print(f"README words: {len(readme.read_text().split()) if readme.exists() else 0}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
