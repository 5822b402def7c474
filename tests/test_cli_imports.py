"""What each command imports, from ``python -X importtime``: only its own modules.

A command pays for every module it imports before it does anything, on
every run. Each row names the modules a command may import: the project's
by name (``x.*`` is x and every module below it), other packages by their
top-level name; anything else it imports fails the test, with its name.
The standard library is free, except its protocol stacks in a ``--help``
(`PROTOCOLS`). Rows name modules, never times.

The ``--help`` rows run alone; ``bmdb machines`` runs against a migrated
BMDB; ``node bootstrap`` and ``owner nodes`` against a real node (the
node's own imports are counted until it is stopped, the lazy ones of its
later work included).
"""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from tests.metropolis.test_node_cli import LEADS, bootstrap_args, node

#: The standard library's network stacks: no ``--help`` needs one.
PROTOCOLS = {"ssl", "asyncio", "socket", "selectors", "http", "email", "concurrent"}

#: Trio and the packages it imports.
TRIO = "trio attr attrs outcome sniffio sortedcontainers idna"
#: The node half's wire: TLS keys and certificates, HTTP/2, the generated
#: protobuf messages (betterproto2's, whose generated stubs import grpclib).
WIRE = "cryptography bcrypt h2 hpack hyperframe betterproto2 dateutil typing_extensions"
WIRE += " grpclib multidict"

#: What every command's parser may import of the project.
PARSING = "common common.exitcodes common.lazy common.cli common.listen common.numbers"

#: (argv after ``python -m``, what it may import: project modules and other
#: packages, separated by spaces).
HELP: list[tuple[list[str], str]] = [
    (["metropolis", "--help"], f"{PARSING} metropolis metropolis.errors"),
    (["metropolis", "owner", "--help"], f"{PARSING} metropolis metropolis.errors"),
    (["metropolis", "node", "run", "--help"], f"{PARSING} metropolis metropolis.errors"),
    (
        ["bmdb", "--help"],
        f"{PARSING} bmdb bmdb.cli bmdb.errors bmdb.model bmdb.model.enums bmdb.model.rows"
        " bmdb.retention",
    ),
    (
        ["shepherd", "--help"],
        f"{PARSING} common.commands shepherd shepherd.arguments shepherd.errors shepherd.rate"
        " bmdb bmdb.errors bmdb.model bmdb.model.enums bmdb.retention",
    ),
    (
        ["shepherd", "install", "--help"],
        f"{PARSING} shepherd shepherd.install_options bmdb bmdb.errors bmdb.model"
        " bmdb.model.enums bmdb.model.rows",
    ),
    (
        ["shepherd", "upgrade", "--help"],
        f"{PARSING} shepherd shepherd.upgrade_options",
    ),
    (
        ["console", "--help"],
        f"{PARSING} console console.errors bmdb bmdb.cli bmdb.errors metropolis metropolis.errors",
    ),
    # bin/demo's.
    (["shepherd.demo", "--help"], f"{PARSING} common.commands shepherd shepherd.demo"),
]

#: ``bmdb machines``: the connection and the views; no action, backup,
#: metrics, nor anything of the node half.
BMDB_MACHINES = (
    f"{PARSING} common.text common.sshkey common.backoff common.crashpoint"
    " bmdb bmdb._pg bmdb.pgerrors bmdb.pgbounds bmdb._pool bmdb.backoff bmdb.cli bmdb.cli.cells"
    " bmdb.cli.views"
    " bmdb.connection bmdb.errors bmdb.migrations bmdb.model.* bmdb.overview bmdb.retention"
    f" bmdb.session bmdb.transaction bmdb.work {TRIO} psycopg psycopg_binary typing_extensions"
)

#: ``owner nodes``: the owner's keys, TLS, the RPC client, the escape of the
#: nodes' own texts (a rollback's cause); no etcd client, curator,
#: supervisor, RPC server or metrics.
OWNER_NODES = (
    f"{PARSING} common.backoff common.crashpoint common.numbers common.protobuf"
    " common.protowire common.text"
    " metropolis metropolis.errors metropolis.cli metropolis.cli.owner metropolis.cli.ownerlink"
    " metropolis.cli.root"
    " metropolis.owner metropolis.pki metropolis.identity metropolis.localstorage"
    " metropolis.localstorage.* common.durable"
    " metropolis.crashpoint metropolis.proto.* metropolis.roleserve metropolis.roleserve.disk"
    " metropolis.roleserve.values metropolis.consensus metropolis.consensus.settings"
    " metropolis.curator metropolis.curator.settings metropolis.rpc metropolis.rpc.auth"
    " metropolis.rpc.channel metropolis.rpc.client metropolis.rpc.limits metropolis.rpc.method"
    " metropolis.rpc.methods metropolis.rpc.pipe metropolis.rpc.status metropolis.rpc.tls"
    " metropolis.rpc.transport metropolis.rpc.streams metropolis.rpc.frameguard"
    " metropolis.rpc.headerblocks metropolis.rpc.h2conn"
    f" metropolis.rpc.wire {TRIO} {WIRE}"
)

#: ``node bootstrap`` (the whole node, without --metrics-listen): none of
#: the owner's, the image builder's or the metrics' modules, and nothing
#: of the fleet half.
NODE = f"{PARSING} common.* metropolis metropolis.* {TRIO} {WIRE}"
NODE_NEVER = (
    "metropolis.cli.owner metropolis.cli.member metropolis.owner metropolis.image.*"
    " metropolis.demo metropolis.roleserve.metrics metropolis.rpc.metrics common.metrics"
    " common.asgi"
)


def _stdlib(name: str) -> bool:
    top = name.split(".")[0]
    # Interpreter internals, site's hooks and the editable install's finder
    # are the interpreter's own.
    return (
        top in sys.stdlib_module_names
        or top.startswith("_")
        or top in ("sitecustomize", "usercustomize")
    )


def imported(stderr: str) -> set[str]:
    """The modules named in ``python -X importtime`` output.

    It names a failed import too (psycopg probes for psycopg_c, betterproto2
    for pydantic): a top-level package that is not installed was not
    imported, and is left out.
    """
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name != "imported package":
                names.add(name)
    tops = {name.split(".")[0] for name in names}
    missing = {top for top in tops if importlib.util.find_spec(top) is None}
    return {name for name in names if name.split(".")[0] not in missing}


def _matches(name: str, pattern: str) -> bool:
    if pattern.endswith(".*"):
        return name == pattern[:-2] or fnmatch.fnmatchcase(name, pattern)
    return name == pattern


def outside(names: set[str], allowed: str, never: str = "", *, help_: bool = False) -> list[str]:
    """The modules of ``names`` that the lists (names and patterns separated
    by spaces) do not allow, sorted."""
    ours = ("metropolis", "bmdb", "shepherd", "console", "common")
    allow, deny = allowed.split(), never.split()
    bad = []
    for name in names:
        top = name.split(".")[0]
        if _stdlib(name):
            if help_ and top in PROTOCOLS:
                bad.append(name)
        elif top in ours:
            if not any(_matches(name, p) for p in allow) or any(_matches(name, p) for p in deny):
                bad.append(name)
        elif top not in allow:
            bad.append(name)
    return sorted(bad)


def _run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


@pytest.mark.parametrize(("argv", "allowed"), HELP, ids=[" ".join(argv) for argv, _ in HELP])
def test_a_help_imports_only_its_parser(argv: list[str], allowed: str) -> None:
    run = _run(argv)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "usage:" in run.stdout
    assert outside(imported(run.stderr), allowed, help_=True) == []


def test_a_usage_error_imports_only_the_parser() -> None:
    run = _run(["metropolis", "owner", "--owner-key", "k", "nodes"])
    assert run.returncode == 2, run.stderr[-2000:]
    assert outside(imported(run.stderr), HELP[0][1], help_=True) == []


def test_bmdb_machines_imports_the_views_only(bmdb_url: str) -> None:
    migrate = _run(["bmdb", "--url", bmdb_url, "migrate"])
    assert migrate.returncode == 0, migrate.stderr[-2000:]
    run = _run(["bmdb", "--url", bmdb_url, "machines"])
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("MACHINE")
    assert outside(imported(run.stderr), BMDB_MACHINES) == []


async def test_a_node_and_the_owner_s_nodes_import_only_their_own(tmp_path: Path) -> None:
    owner_key = ["--owner-key", str(tmp_path / "owner.pem")]
    with trio.fail_after(120):
        async with node(*bootstrap_args(tmp_path), env={"PYTHONPROFILEIMPORTTIME": "1"}) as first:
            await first.wait_for(LEADS)
            await first.wait_for("status pushed")
            owner = await trio.to_thread.run_sync(
                lambda: _run(
                    ["metropolis", "owner", "--root", str(tmp_path / "n"), *owner_key, "nodes"],
                    env={**os.environ, "PYTHONPROFILEIMPORTTIME": "0"},
                )
            )
            first.process.send_signal(signal.SIGTERM)
    assert first.process.returncode == 0
    assert owner.returncode == 0, owner.stderr[-2000:]
    assert "127.0.0.1" in owner.stdout
    assert outside(imported(owner.stderr), OWNER_NODES) == []
    modules = imported("\n".join(first.lines))
    assert {"metropolis.roleserve.server", "metropolis.curator.service"} <= modules
    assert outside(modules, NODE, NODE_NEVER) == []


def test_the_check_sees_a_module_outside_the_list() -> None:
    """The lists are read as meant: a stray module of ours or another
    package's, or a protocol stack in a help, is named."""
    names = {"bmdb", "bmdb.actions", "psycopg", "ssl", "trio._core"}
    assert outside(names, "bmdb trio", help_=True) == ["bmdb.actions", "psycopg", "ssl"]
    assert outside({"metropolis.owner"}, "metropolis.*", "metropolis.owner") == ["metropolis.owner"]
    assert outside({"ssl", "metropolis.rpc"}, "metropolis.*") == []
