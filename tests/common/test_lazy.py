"""Packages whose public names are imported on first use (`common.lazy`).

Each such ``__init__`` names its exports twice: as imports under
``TYPE_CHECKING`` (what mypy checks callers against) and in the table
given to `exports` (what runs). These tests hold the two equal, and every
name to the object of the module it comes from.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from common.lazy import exports

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("metropolis", "bmdb", "shepherd", "console", "common")


def _lazy_packages() -> dict[str, Path]:
    """Every module (a package's __init__ mostly) that calls exports()."""
    found = {}
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.name != "lazy.py" and "__getattr__ = exports(" in path.read_text():
                parts = path.relative_to(ROOT).with_suffix("").parts
                name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                found[name] = path
    return found


LAZY = _lazy_packages()


def _both_lists(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(name -> module) under TYPE_CHECKING, and in the table given to exports()."""
    typed: dict[str, str] = {}
    table: dict[str, str] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom) and stmt.module, ast.unparse(stmt)
                for alias in stmt.names:
                    # "X as X": the re-export form, so that mypy sees a public name.
                    assert alias.asname == alias.name, ast.unparse(stmt)
                    typed[alias.name] = stmt.module
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "exports":
            mapping = node.args[1]
            assert isinstance(mapping, ast.Dict)
            for key, value in zip(mapping.keys, mapping.values, strict=True):
                assert isinstance(key, ast.Constant) and isinstance(value, ast.List)
                for element in value.elts:
                    assert isinstance(element, ast.Constant)
                    table[str(element.value)] = str(key.value)
    return typed, table


def test_the_packages_are_found() -> None:
    assert {"bmdb", "bmdb.model", "metropolis.rpc", "shepherd.demo"} <= set(LAZY)


@pytest.mark.parametrize("package", sorted(LAZY))
def test_what_mypy_sees_is_what_runs(package: str) -> None:
    typed, table = _both_lists(LAZY[package])
    assert typed == table
    module = importlib.import_module(package)
    for name, source in table.items():
        assert getattr(module, name) is getattr(importlib.import_module(source), name)
    # What __all__ names is the table's, or defined in the module itself.
    assert all(name in table or name in vars(module) for name in getattr(module, "__all__", ()))


def test_an_unknown_name_is_an_attribute_error() -> None:
    getattr_ = exports("common", {"common.text": ["printable"]})
    with pytest.raises(AttributeError, match="'common' has no attribute 'nothing'"):
        getattr_("nothing")
    with pytest.raises(ImportError):
        exports("common", {"common.no_such_module": ["x"]})("x")


def test_importing_a_package_imports_none_of_its_exports() -> None:
    """The point of it all: ``import bmdb`` does not import the driver."""
    code = (
        "import sys, bmdb, bmdb.model, metropolis.rpc, metropolis.consensus;"
        "print(' '.join(m for m in ('psycopg', 'trio', 'h2', 'bmdb.connection',"
        " 'metropolis.rpc.server', 'metropolis.consensus.service') if m in sys.modules))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == ""


def test_a_name_s_module_shows_in_python_s_import_times() -> None:
    """A module imported on first use is in ``python -X importtime``'s
    output, which tests/test_cli_imports.py reads: importlib.import_module
    bypasses the timing, and the test did not see bmdb machines import
    bmdb.overview.listing."""
    code = "import bmdb.overview; bmdb.overview.machines_params"
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, check=True
    )
    timed = {line.rsplit("|", 1)[1].strip() for line in run.stderr.splitlines() if "|" in line}
    assert "bmdb.overview.listing" in timed
