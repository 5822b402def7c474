"""The BMDB's modules import one way: CLI -> connection -> session -> work ->
transaction -> model/migrations/pool -> driver (see ARCHITECTURE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

#: Each module's layer; a module may import only from lower layers. The
#: modules of one package (bmdb.model, bmdb.migrations) share their layer.
LAYERS = {
    "bmdb.errors": 0,
    "bmdb._pg": 1,
    "bmdb.backoff": 1,
    "bmdb.model": 2,
    "bmdb.migrations": 2,
    "bmdb._pool": 2,
    "bmdb.transaction": 3,
    "bmdb.work": 4,
    "bmdb.session": 5,
    "bmdb.connection": 6,
    "bmdb.localserver": 7,
    "bmdb.localha": 8,
    # Operator views, and what shows them (metrics; the web UI is the
    # console's, above this package).
    "bmdb.overview": 7,
    "bmdb.metrics": 7,
    # Operator actions (each with its audit record).
    "bmdb.actions": 7,
    "bmdb.cli": 8,
    "bmdb": 8,
    "bmdb.__main__": 9,
}

#: Read as source, not imported, so that the check works on any tree.
ROOT = Path(__file__).resolve().parents[2] / "bmdb"


def _unit(module: str) -> str:
    """The entry of `LAYERS` that ``module`` belongs to."""
    while module not in LAYERS:
        module = module.rsplit(".", 1)[0]
    return module


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The bmdb modules that ``path`` imports, anywhere in it (also under
    TYPE_CHECKING or inside functions)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "bmdb")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != "bmdb":
                continue
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in modules else node.module)
    return found


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def test_every_module_has_a_layer() -> None:
    assert all(_unit(name) in LAYERS for name in _modules())


def test_imports_only_go_down() -> None:
    upward = []
    for name, path in sorted(_modules().items()):
        unit = _unit(name)
        for imported in _imports(path, set(_modules())):
            target = _unit(imported)
            if target != unit and LAYERS[target] >= LAYERS[unit]:
                upward.append(f"{name} imports {imported}")
    assert not upward, upward


def test_no_public_signature_shows_the_driver_connection() -> None:
    """Above the driver, code sees `Queries` (or a protocol), never
    ``bmdb._pg.PgConnection``: the driver can change without the API."""
    shown = []
    for name, path in sorted(_modules().items()):
        if any(part.startswith("_") and part != "__main__" for part in name.split(".")):
            continue  # private modules (the driver, the pool) may
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if node.name.startswith("_") and not node.name.startswith("__"):
                continue
            annotations = [a.annotation for a in (*node.args.args, *node.args.kwonlyargs)]
            annotations.append(node.returns)
            if any(a is not None and "PgConnection" in ast.unparse(a) for a in annotations):
                shown.append(f"{name}.{node.name}")
    assert not shown, shown
