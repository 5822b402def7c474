"""The BMDB's modules import one way: CLI -> connection -> session -> work ->
transaction -> model/migrations/pool -> driver (see ARCHITECTURE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.layering import package_modules, unit, upward

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
    # LISTEN on a connection of its own (the driver's), beside the pool.
    "bmdb.notify": 3,
    "bmdb.work": 4,
    "bmdb.session": 5,
    "bmdb.connection": 6,
    "bmdb.localserver": 7,
    "bmdb.localha": 8,
    # The Patroni members' and HAProxy's configurations (pure functions).
    "bmdb.localha_config": 7,
    # Operator views, and what shows them (metrics; the web UI is the
    # console's, above this package).
    "bmdb.overview": 7,
    "bmdb.metrics": 7,
    # Operator actions (each with its audit record).
    "bmdb.actions": 7,
    # Retention of the work history and the audit log.
    "bmdb.retention": 7,
    # Backup and restore (pg_dump, psql).
    "bmdb.backup": 7,
    # The CLI's commands (bmdb.cli.views, bmdb.cli.operate), each imported
    # by bmdb.__main__ when it runs.
    "bmdb.cli": 8,
    "bmdb": 8,
    "bmdb.__main__": 9,
}

#: Read as source, not imported, so that the check works on any tree.
ROOT = Path(__file__).resolve().parents[2] / "bmdb"


def test_every_module_has_a_layer() -> None:
    for name in package_modules(ROOT):
        unit(name, LAYERS)  # KeyError names a module in no layer


def test_imports_only_go_down() -> None:
    found = upward(package_modules(ROOT), LAYERS)
    assert not found, found


def test_no_public_signature_shows_the_driver_connection() -> None:
    """Above the driver, code sees `Queries` (or a protocol), never
    ``bmdb._pg.PgConnection``: the driver can change without the API."""
    shown = []
    for name, path in sorted(package_modules(ROOT).items()):
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
