#!/usr/bin/env python
"""Fail on any import cycle between the modules of a package, counting every import.

    tools/check_cycles.py [PACKAGE_DIR]      (default: mpformer/ beside this file's parent)

import-linter skips imports under `if TYPE_CHECKING:` (the contracts exclude them) and cannot tell
a lazy import inside a function from a module-level one; both are the usual ways a child hides a
reference back to the module that builds it. This checker reads every `import` / `from ... import`
statement of every .py file with ast, wherever it sits (module level, TYPE_CHECKING block, function
body), resolves it to a module of the package, and prints one line per cycle of modules, exit 1.

A package's __init__ is a module too; `from pkg import name` counts as an edge to pkg.name when that
is a module, else to pkg itself.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the package directory `root`."""
    names: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _absolute(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute dotted name of a (possibly relative) `from` import inside `module`."""
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The longest known module that `name` is or lies inside (an attribute import names its module)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module of the package that `module` imports, at any depth of its syntax tree."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):  # walks TYPE_CHECKING blocks and function bodies alike
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, is_package, node.level, node.module)
            targets = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            owner = _owner(target, modules)
            if owner is not None and owner != module:
                found.add(owner)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted, in order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, for the package directory `root`."""
    modules = module_names(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0]) if args else Path(__file__).resolve().parent.parent / "mpformer"
    if not (root / "__init__.py").is_file():
        print(f"check_cycles: {root} is not a package directory (it has no __init__.py)", file=sys.stderr)
        return 2
    graph = import_graph(root)
    found = cycles(graph)
    for component in found:
        print(f"import cycle: {' <-> '.join(component)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
