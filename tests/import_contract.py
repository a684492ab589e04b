"""The import contract: which layer each module of a package belongs to, and which layers it may import.

The layer table is read from docs/architecture.md (the table under "The import contract"), so the
document and the test cannot drift apart. Imports are read with `ast` from the source, including
imports inside functions: a lazy import is still an arrow between layers.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Layer:
    name: str
    modules: tuple[str, ...]  # module names or package prefixes
    may_import: tuple[str, ...]  # names of the layers below that it may import (its own is implied)


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package under `root` (the folder that holds the package), by dotted name;
    a package's `__init__.py` is named after the package."""
    names: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def read_imports(root: Path, package: str) -> list[Import]:
    """The package-internal imports of every module: `from a import b` counts as importing the module
    `a.b` when that is a module, else `a`."""
    modules = module_names(root, package)
    found: list[Import] = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                if target == package or target.startswith(package + "."):
                    found.append(Import(name, target, node.lineno))
    return found


def read_layer_table(doc: Path) -> list[Layer]:
    """The rows of the import-contract table, top layer first: `| layer | modules | may import |`."""
    text = doc.read_text()
    start = text.index("## The import contract")
    layers: list[Layer] = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("## "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not line.startswith("|") or set(cells[0]) <= set("-: ") or cells[0] == "layer":
            continue
        modules = tuple(re.findall(r"`([\w.]+)`", cells[1]))
        may = () if cells[2] in ("", "-", "nothing") else tuple(w.strip() for w in cells[2].split(","))
        layers.append(Layer(cells[0], modules, may))
    if not layers:
        raise ValueError(f"{doc}: no import-contract table found")
    return layers


def check_table(layers: list[Layer]) -> list[str]:
    """A layer may only be allowed layers below it, each named once."""
    problems = []
    order = [layer.name for layer in layers]
    for i, layer in enumerate(layers):
        for other in layer.may_import:
            if other not in order:
                problems.append(f"layer {layer.name!r} may import {other!r}, which is not a layer")
            elif order.index(other) <= i:
                problems.append(f"layer {layer.name!r} may import {other!r}, which is not below it")
    return problems


def layer_of(module: str, layers: list[Layer], package: str) -> Layer | None:
    """The layer whose entry matches the module most specifically; the bare package name matches
    only the package's own `__init__`."""
    best: tuple[int, Layer] | None = None
    for layer in layers:
        for entry in layer.modules:
            if module == entry or (entry != package and module.startswith(entry + ".")):
                if best is None or len(entry) > best[0]:
                    best = (len(entry), layer)
    return best[1] if best else None


def check_imports(root: Path, package: str, layers: list[Layer]) -> list[str]:
    """Every import that points up (or sideways past) the layer order, and every module outside the table."""
    problems = []
    for name in module_names(root, package):
        if layer_of(name, layers, package) is None:
            problems.append(f"{name}: in no layer of the table")
    for imp in dict.fromkeys(read_imports(root, package)):  # one line may name a module twice
        src, dst = layer_of(imp.importer, layers, package), layer_of(imp.imported, layers, package)
        if src is None or dst is None or src is dst or dst.name in src.may_import:
            continue
        problems.append(f"{imp.importer}:{imp.line} imports {imp.imported} ({src.name} -> {dst.name}, not allowed)")
    return problems


def find_cycles(root: Path, package: str) -> list[list[str]]:
    """The module-level import cycles (strongly connected components of more than one module, or a
    module importing itself), each sorted."""
    graph: dict[str, set[str]] = {name: set() for name in module_names(root, package)}
    for imp in read_imports(root, package):
        if imp.imported in graph:
            graph[imp.importer].add(imp.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the package is small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
            if len(component) > 1 or v in graph[v]:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles
