"""``python -m shepherd upgrade`` against a real BMDB: refusals, the plan, one run at
a time, --status and --stop, and the audit records (the work itself is the
upgrader's: tests/test_upgrade_e2e.py)."""

from __future__ import annotations

import datetime
import sys
import uuid
from collections.abc import Iterator

import pytest
import trio

import bmdb
from bmdb.model import Queries
from shepherd.proto.agent_callback import UpgradeRequest
from tests.bmdb.helpers import add_provided_machines
from tests.shepherd.test_install import SHA, _serve

NEW = f"sha256:{SHA}"
OLD = "sha256:" + "0" * 64


@pytest.fixture
def image_server() -> Iterator[str]:
    yield from _serve()


async def upgrade(*args: str) -> tuple[int, str, str]:
    result = await trio.run_process(
        [sys.executable, "-m", "shepherd", "upgrade", *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    return result.returncode, result.stdout.decode(), result.stderr.decode()


async def _machines(conn: bmdb.Connection) -> tuple[uuid.UUID, uuid.UUID, uuid.UUID]:
    """An installed machine, one installed with the new image already, one not installed."""
    a, b, c = await add_provided_machines(conn, 3)

    async def body(q: Queries) -> None:
        for n, (mid, digest) in enumerate(((a, OLD), (b, NEW))):
            await q.set_os_installation_request(
                mid, 1, b"req", root_device="disk0", image_digest=digest, node_address="10.0.0.1"
            )
            await q.record_os_installation_report(mid, 1, b"ok", True, None, bytes([n]) * 32)
            await q.set_agent_started(mid, datetime.datetime.now(datetime.UTC), bytes([n]) * 32)

    await conn.transact(body)
    return a, b, c


def _image(server: str) -> list[str]:
    return ["--image-server", f"http://{server}", "--image-digest", NEW, "--insecure-plain-http"]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        ([], "--machines ID[,ID...] or --all"),
        (["--all", "--machines", str(uuid.uuid4())], "--machines ID[,ID...] or --all"),
        (["--all"], "the image"),
        (["--all", "--max-unavailable", "0"], "want a count from 1 to 1000"),
        (["--all", "--health-timeout", "1"], "want 5 to 86400 seconds"),
        (["--all", "--machines", "nope"], "not machine ids"),
        (["--stop"], "--stop needs --reason"),
        (
            [
                *("--all", "--image-url", f"http://h/images/sha256/{SHA}"),
                *("--insecure-plain-http", "--cluster-owner-key", "/nonexistent"),
            ],
            "--cluster-owner-key goes with",
        ),
    ],
)
async def test_bad_options_are_refused_with_exit_2(args: list[str], said: str) -> None:
    code, out, err = await upgrade("--bmdb-url", "postgresql:///nowhere", *args)
    assert code == 2 and said in err and out == "", (code, out, err)
    assert "Traceback" not in err


async def test_a_run_is_planned_written_audited_and_stopped(
    bmdb_conn: bmdb.Connection, bmdb_url: str, image_server: str
) -> None:
    a, b, c = await _machines(bmdb_conn)
    code, out, err = await upgrade("--bmdb-url", bmdb_url, "--status")
    assert (code, out.strip()) == (0, "no upgrade run yet"), err
    # The image server lacks the image: the whole run refused, nothing written.
    code, out, err = await upgrade(
        *("--bmdb-url", bmdb_url, "--all", "--image-server", f"http://{image_server}"),
        *("--image-digest", "sha256:" + "1" * 64, "--insecure-plain-http"),
    )
    assert code == 1 and "does not have" in err, (code, out, err)
    # A dry run says what it would do, and writes nothing.
    code, out, err = await upgrade(
        "--bmdb-url", bmdb_url, "--machines", f"{a},{b},{c}", *_image(image_server), "--dry-run"
    )
    assert code == 0, err
    assert f"would upgrade #1 {a} node - (workers) from {OLD[:19]}" in out, out
    assert f"left out {b}: already runs {NEW[:19]}" in out
    assert f"left out {c}: not installed" in out
    assert "dry run: nothing written" in out
    assert await bmdb_conn.transact(lambda q: q.upgrade_runs()) == []
    # The run.
    code, out, err = await upgrade(
        *("--bmdb-url", bmdb_url, "--all", *_image(image_server), "--operator", "ops"),
        *("--reason", "CVE fix", "--health-timeout", "120"),
    )
    assert code == 0, err
    assert f"upgrade #1 {a}" in out and "1 machine(s) to" in out, out
    [run] = await bmdb_conn.transact(lambda q: q.upgrade_runs())
    assert (run.image_digest, run.health_timeout, run.requested_by) == (NEW, 120, "ops")
    audit = await bmdb_conn.transact(
        lambda q: q.execute("SELECT action, machine_id, reason FROM audit_log ORDER BY id")
    )
    assert [tuple(r) for r in audit] == [("upgrade", None, "CVE fix"), ("upgrade", a, "CVE fix")]
    # The machine is asked to write the image now (no activate: no node
    # goes down), and stays pending until the upgrader activates it.
    [(row, _)] = await bmdb_conn.transact(lambda q: q.upgrade_machines(run.run_id))
    raw = await bmdb_conn.transact(
        lambda q: q.execute("SELECT request_raw FROM machine_upgrade WHERE machine_id = %s", (a,))
    )
    asked = UpgradeRequest.parse(bytes(raw[0][0]))
    assert (row.state, row.generation, row.requested_at) == ("pending", 1, None)
    assert (asked.generation, asked.activate, asked.root_device) == (1, False, "disk0")
    assert asked.os_image == run.os_image and run.os_image  # the image the run names
    # One run at a time.
    code, out, err = await upgrade("--bmdb-url", bmdb_url, "--all", *_image(image_server))
    assert code == 1 and "is not finished: one run at a time" in err, (code, out, err)
    code, out, err = await upgrade("--bmdb-url", bmdb_url, "--status")
    assert code == 0 and "running" in out and f"{a} pending" in out, out
    code, out, err = await upgrade("--bmdb-url", bmdb_url, "--stop", "--reason", "wrong image")
    assert code == 0 and "stopped" in out, err
    code, out, err = await upgrade("--bmdb-url", bmdb_url, "--status")
    assert "stopped: stopped by" in out and "wrong image" in out, out
    code, out, err = await upgrade("--bmdb-url", bmdb_url, "--stop", "--reason", "again")
    assert code == 1 and "no upgrade run is running" in err, (code, out, err)
