"""`pip install pagoda` brings everything the package imports outside its optional extras; plotting
is the `pagoda[bench]` extra, and `bench serve --plot` without it says how to install it."""

from __future__ import annotations

import ast
import importlib.metadata as md
import importlib.util
import re
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Imported only by optional features, each from an extra or the machine: the ray executor (ray),
# tracing (otel), the GPU kernels (triton), plotting (bench); readline is the platform's.
OPTIONAL = {"ray": "ray", "opentelemetry": "otel", "triton": "dev", "matplotlib": "bench"}


def _requirement_names(reqs: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!;\[~]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


def _imported_top_modules() -> set[str]:
    names = set()
    for path in (REPO / "pagoda").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return {n for n in names if n != "pagoda" and n not in sys.stdlib_module_names and n != "__future__"}


def test_every_imported_distribution_is_declared():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = _requirement_names(project["dependencies"])
    extras = {name: _requirement_names(reqs) for name, reqs in project["optional-dependencies"].items()}
    dists = md.packages_distributions()
    for module in sorted(_imported_top_modules()):
        names = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
        if module in OPTIONAL:
            assert names & extras[OPTIONAL[module]], f"{module}: not in the {OPTIONAL[module]} extra"
            assert not names & declared, f"{module} is optional, but a runtime dependency"
        else:
            assert names & declared, f"pagoda imports {module} ({', '.join(sorted(names))}), undeclared in pyproject.toml"


def test_plot_without_matplotlib_says_how_to_install(monkeypatch):
    from pagoda.bench.plot import check_plotting_available

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'pagoda\[bench\]'"):
        check_plotting_available()
    monkeypatch.undo()
    check_plotting_available()  # installed here: no error
