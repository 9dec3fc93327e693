"""The suite collects wherever an extra is missing: a test module imports an optional package at module level only
after pytest.importorskip of it (the module then skips with the reason), never bare.

`bash tests/run --quick` runs without the server extra (torch, sglang), and CI collects that selection in such
a venv; this check covers the dev extra's packages too, which that venv has, by reading the modules' source."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# Packages a test may need that the base and sidecar installs do not bring.
OPTIONAL = {
    "torch",
    "triton",
    "sglang",
    "transformers",
    "huggingface_hub",
    "flashinfer",
    "yaml",
    "promql_parser",
    "kubernetes_validate",
}


def bare_optional_imports(source: str) -> list[str]:
    """`line: module` for each module-level import of an optional package not preceded by its importorskip."""
    skipped: set[str] = set()
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        for call in ast.walk(node):
            if (
                isinstance(call, ast.Call)
                and getattr(call.func, "attr", "") == "importorskip"
                and call.args
                and isinstance(call.args[0], ast.Constant)
            ):
                skipped.add(str(call.args[0].value).split(".")[0])
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        found += [f"{node.lineno}: {n}" for n in names if n.split(".")[0] in OPTIONAL - skipped]
    return found


def test_no_test_module_imports_an_optional_package_without_skipping_first():
    modules = sorted([*TESTS.rglob("test_*.py"), *TESTS.rglob("conftest.py")])
    assert len(modules) > 20
    bare = {str(m.relative_to(TESTS)): b for m in modules if (b := bare_optional_imports(m.read_text()))}
    assert bare == {}, "import these after pytest.importorskip(name, reason=...), or inside the tests"


def test_the_check_sees_a_bare_import_and_accepts_one_after_its_skip():
    assert bare_optional_imports("import os\nimport yaml\nfrom torch import nn\n") == ["2: yaml", "3: torch"]
    guarded = 'import pytest\ntorch = pytest.importorskip("torch", reason="x")\nimport torch.nn\n'
    assert bare_optional_imports(guarded) == []
    assert bare_optional_imports("def f():\n    import yaml\n") == []
