"""The layer order of docs/architecture.md holds in `pagoda/`: no import points up, no import cycle,
no module over 400 lines. The checker is tested on fake packages so that it is known to fail."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.import_contract import (
    Layer,
    check_imports,
    check_table,
    find_cycles,
    module_names,
    read_imports,
    read_layer_table,
)

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "architecture.md"
MAX_LINES = 400


def test_the_layer_table_is_ordered():
    layers = read_layer_table(DOC)
    assert check_table(layers) == []
    assert [layer.name for layer in layers][-1] == "base"


def test_no_import_points_up_the_layer_order():
    assert check_imports(REPO, "pagoda", read_layer_table(DOC)) == []


def test_no_import_cycle_between_modules():
    assert find_cycles(REPO, "pagoda") == []


def test_no_module_over_400_lines():
    long = {name: n for name, path in module_names(REPO, "pagoda").items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_nothing_refers_to_files_outside_the_repository():
    """The design and the test catalogue live in docs/; a clone must show everything it cites."""
    here = Path(__file__).resolve()
    texts = [REPO / "README.md", REPO / "Makefile", *REPO.glob("docs/*.md"), *REPO.glob("benchmarks/**/*.*"),
             *REPO.glob("pagoda/**/*.py"), *REPO.glob("tests/**/*.py")]
    offenders = [str(p.relative_to(REPO)) for p in texts if p.suffix in ("", ".md", ".py", ".sh") and p != here
                 and ("../shared" in (t := p.read_text()) or "DESIGN.md" in t or "TESTING.md" in t)]
    assert offenders == []


# -- the checker itself, on a fake package ---------------------------------------------------------

FAKE_DOC = """\
# Fake

## The import contract

| layer | modules | may import |
|---|---|---|
| top | `fake`, `fake.top` | low, base |
| low | `fake.low` | base |
| base | `fake.base`, `fake.data` | nothing |

## Afterwards
"""


def _fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in {"fake/__init__.py": "", "fake/low/__init__.py": "", "fake/top/__init__.py": "",
                      **files}.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    (tmp_path / "arch.md").write_text(FAKE_DOC)
    return tmp_path


def test_the_table_is_read_from_the_document(tmp_path):
    root = _fake_package(tmp_path, {})
    assert read_layer_table(root / "arch.md") == [
        Layer("top", ("fake", "fake.top"), ("low", "base")),
        Layer("low", ("fake.low",), ("base",)),
        Layer("base", ("fake.base", "fake.data"), ()),
    ]


def test_downward_imports_pass(tmp_path):
    root = _fake_package(tmp_path, {
        "fake/top/app.py": "from fake.low import runner\nimport fake.base\n",
        "fake/low/runner.py": "from ..base import VALUE\n",
        "fake/base.py": "VALUE = 1\n",
    })
    assert check_imports(root, "fake", read_layer_table(root / "arch.md")) == []
    assert find_cycles(root, "fake") == []


def test_an_upward_import_fails_even_inside_a_function(tmp_path):
    root = _fake_package(tmp_path, {
        "fake/low/runner.py": "def f():\n    from fake.top.app import main\n    return main\n",
        "fake/top/app.py": "def main():\n    pass\n",
        "fake/base.py": "",
    })
    problems = check_imports(root, "fake", read_layer_table(root / "arch.md"))
    assert problems == ["fake.low.runner:2 imports fake.top.app (low -> top, not allowed)"]


def test_an_import_of_the_facade_from_below_fails(tmp_path):
    root = _fake_package(tmp_path, {"fake/base.py": "from fake import something\n"})
    problems = check_imports(root, "fake", read_layer_table(root / "arch.md"))
    assert problems == ["fake.base:1 imports fake (base -> top, not allowed)"]


def test_skipping_a_layer_that_is_not_allowed_fails(tmp_path):
    doc = FAKE_DOC.replace("| low, base |", "| low |")
    root = _fake_package(tmp_path, {"fake/top/app.py": "from fake.base import x\n", "fake/base.py": "x = 1\n"})
    (root / "arch.md").write_text(doc)
    problems = check_imports(root, "fake", read_layer_table(root / "arch.md"))
    assert problems == ["fake.top.app:1 imports fake.base (top -> base, not allowed)"]


def test_a_module_in_no_layer_fails(tmp_path):
    root = _fake_package(tmp_path, {"fake/stray.py": ""})
    assert check_imports(root, "fake", read_layer_table(root / "arch.md")) == ["fake.stray: in no layer of the table"]


def test_a_table_that_allows_an_upward_import_fails():
    layers = [Layer("top", ("a",), ()), Layer("low", ("b",), ("top",))]
    assert check_table(layers) == ["layer 'low' may import 'top', which is not below it"]


def test_cycles_are_found_also_through_relative_and_package_imports(tmp_path):
    root = _fake_package(tmp_path, {
        "fake/low/a.py": "from . import b\n",
        "fake/low/b.py": "from fake.low.c import f\n",
        "fake/low/c.py": "import fake.low.a\n",
        "fake/top/x.py": "from fake.top import y\n",
        "fake/top/y.py": "from .x import z\n",
        "fake/base.py": "",
    })
    assert find_cycles(root, "fake") == [["fake.low.a", "fake.low.b", "fake.low.c"], ["fake.top.x", "fake.top.y"]]
    assert {(i.importer, i.imported) for i in read_imports(root, "fake")} == {
        ("fake.low.a", "fake.low.b"), ("fake.low.b", "fake.low.c"), ("fake.low.c", "fake.low.a"),
        ("fake.top.x", "fake.top.y"), ("fake.top.y", "fake.top.x"),
    }


@pytest.mark.parametrize("missing", ["## The import contract", "| layer |"])
def test_a_document_without_the_table_is_an_error(tmp_path, missing):
    (tmp_path / "arch.md").write_text(FAKE_DOC.split(missing)[0])
    with pytest.raises(ValueError):
        read_layer_table(tmp_path / "arch.md")


def test_the_api_process_does_not_load_torch():
    """The server's API process (the OpenAI app, the async client of the engine core) runs without
    torch: loading it there cost ~200 MB of the server's memory. A fresh interpreter, so that no
    other test's imports count."""
    import subprocess
    import sys

    code = ("import sys, pagoda.serve.app, pagoda.serve.server, pagoda.engine.async_llm; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))[:3])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]", f"the API process's modules import torch: {out.stdout.strip()}"
