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
    # psycopg's errors read for the BMDB; the statement and commit bounds.
    "bmdb.pgerrors": 1,
    "bmdb.pgbounds": 1,
    "bmdb._pg": 2,
    "bmdb.backoff": 2,
    "bmdb.model": 3,
    "bmdb.migrations": 3,
    "bmdb._pool": 3,
    "bmdb.transaction": 4,
    # LISTEN on a connection of its own (the driver's), beside the pool.
    "bmdb.notify": 4,
    "bmdb.work": 5,
    "bmdb.session": 6,
    "bmdb.connection": 7,
    "bmdb.localserver": 8,
    "bmdb.localha": 9,
    # The Patroni members' and HAProxy's configurations (pure functions).
    "bmdb.localha_config": 8,
    # Operator views, and what shows them (metrics; the web UI is the
    # console's, above this package).
    "bmdb.overview": 8,
    "bmdb.metrics": 8,
    # Operator actions (each with its audit record).
    "bmdb.actions": 8,
    # Retention of the work history and the audit log.
    "bmdb.retention": 8,
    # Backup and restore (pg_dump, psql).
    "bmdb.backup": 8,
    # The CLI's commands (bmdb.cli.views, bmdb.cli.operate), each imported
    # by bmdb.__main__ when it runs.
    "bmdb.cli": 9,
    "bmdb": 9,
    "bmdb.__main__": 10,
}

#: Inside bmdb.model (one layer above): the records and checks, then the
#: base every domain's statements derive from, the domains (a module each,
#: one mixin of `Queries`), and `Queries`, which composes them. "bmdb" is
#: the rest of the package, whose layers `LAYERS` checks.
MODEL_LAYERS = {
    "bmdb": 0,
    "bmdb.model.enums": 1,
    "bmdb.model.channels": 1,
    "bmdb.model.checks": 1,
    "bmdb.model.rows": 2,
    # What a source may claim (SQL conditions), and the transaction.
    "bmdb.model.claimable": 2,
    "bmdb.model.base": 2,
    "bmdb.model.machines": 3,
    "bmdb.model.installs": 3,
    "bmdb.model.upgrades": 3,
    "bmdb.model.agents": 4,
    "bmdb.model.history": 4,
    # A tombstone forgets the agent; the recovery source reads its tags.
    "bmdb.model.decommission": 5,
    "bmdb.model.sourcing": 5,
    "bmdb.model.queries": 6,
    # The package's names, imported on first use (common.lazy).
    "bmdb.model": 7,
}

#: Read as source, not imported, so that the check works on any tree.
ROOT = Path(__file__).resolve().parents[2] / "bmdb"


def test_every_module_has_a_layer() -> None:
    for name in package_modules(ROOT):
        unit(name, LAYERS)  # KeyError names a module in no layer


def test_imports_only_go_down() -> None:
    found = upward(package_modules(ROOT), LAYERS)
    assert not found, found


def test_model_modules_import_only_down() -> None:
    """A domain's statements import the checks, the base and the domains
    they build on, never `Queries` nor a domain that builds on them."""
    model = {n: p for n, p in package_modules(ROOT).items() if unit(n, LAYERS) == "bmdb.model"}
    assert sorted(set(model) - set(MODEL_LAYERS)) == []  # a model module in no layer
    found = upward(model, MODEL_LAYERS)
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
