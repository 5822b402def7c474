"""The BMDB package does not depend on the trio-asyncio bridge."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import bmdb

PACKAGE = Path(bmdb.__file__).parent


def test_no_module_imports_trio_asyncio() -> None:
    importers = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            if any(name.split(".")[0] == "trio_asyncio" for name in names):
                importers.append(str(path.relative_to(PACKAGE.parent)))
    assert importers == []


def test_importing_every_module_loads_no_trio_asyncio() -> None:
    modules = sorted(
        ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        for path in PACKAGE.rglob("*.py")
    )
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "sys.exit('trio_asyncio' in sys.modules)\n"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
