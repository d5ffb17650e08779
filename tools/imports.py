"""The library's import graph, read from the source (no import is run): which module of
ringflash (and ringflash.kernels, the kernels/ folder) imports which, whether any import
circle exists, and the library files' lengths.

    python tools/imports.py            # edges, by module, then circles (none, one hopes)
    python tools/imports.py --dot      # the graph in Graphviz's language

Imports inside functions count as much as those at the top: a circle closed by a late
import is still a circle. The floors the design fixes (docs/design.md, "Layout of the
repository") are checked by tests/test_structure.py.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"ringflash": ROOT / "ringflash", "ringflash.kernels": ROOT / "kernels"}


def modules() -> dict[str, Path]:
    """Every library module by dotted name (packages by their own name)."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[0] == "kernels" and package == "ringflash":
                continue
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join((package, *parts))] = path
    return found


def _resolve(importer: str, is_package: bool, module: str | None, level: int) -> str:
    """The absolute name ``from <level dots><module> import ...`` refers to in ``importer``."""
    if level == 0:
        return module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The library modules ``name`` (at ``path``) imports, at any depth of its code."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, is_package, node.module, node.level)
            # ``from package import module`` names a module; ``from module import name`` does not
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _package_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """Edges between modules that are not a package and one of its own submodules: a
    package's __init__ re-exports its modules, which is not a circle of the design."""
    def inside(a: str, b: str) -> bool:
        return b.startswith(a + ".") or a.startswith(b + ".")
    return {a: {b for b in bs if not inside(a, b)} for a, bs in edges.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dot", action="store_true", help="print the graph in Graphviz's language")
    args = p.parse_args(argv)
    edges = _package_edges(graph())
    if args.dot:
        print("digraph ringflash {\n  rankdir=LR;")
        for a in sorted(edges):
            for b in sorted(edges[a]):
                print(f'  "{a}" -> "{b}";')
        print("}")
        return
    lengths = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    for a in sorted(edges):
        print(f"{a} ({lengths[a]} lines) -> {', '.join(sorted(edges[a])) or '-'}")
    found = circles(edges)
    print("circles: " + ("; ".join(" <-> ".join(c) for c in found) if found else "none"))


if __name__ == "__main__":
    main()
