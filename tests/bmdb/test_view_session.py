"""``bmdb ... LISTING --keep-open SECONDS``: a session process answers later
listings of the same database as the same listing in a process of its own
would (`bmdb.cli.viewlink`, `bmdb.cli.viewsession`)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.fleet import Fleet, seed_fleet
from bmdb import __main__ as cli
from bmdb.cli import viewlink
from bmdb.localserver import LocalPostgres
from tests.test_cli_imports import imported

PROJECT = Path(__file__).resolve().parents[2]


@pytest.fixture
def runtime() -> Iterator[Path]:
    """A private XDG_RUNTIME_DIR, short enough for the sockets below it."""
    folder = Path(tempfile.mkdtemp(prefix="kv-"))
    yield folder
    for log in folder.glob("bmdb-views-*/*.log"):
        found = re.search(r"\(pid (\d+)\)", log.read_text())
        if found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(found.group(1)), signal.SIGKILL)
    shutil.rmtree(folder, ignore_errors=True)


def _bmdb(
    runtime: Path, *argv: str, importtime: bool = False, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "bmdb", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={
            **os.environ,
            **(env or {}),
            "XDG_RUNTIME_DIR": str(runtime),
            "PYTHONPATH": str(PROJECT),
        },
    )


def _wait_for_socket(runtime: Path) -> None:
    deadline = time.monotonic() + 60
    while not list(runtime.glob("bmdb-views-*/*.sock")):
        assert time.monotonic() < deadline, "no session socket"
        time.sleep(0.05)


def test_the_scan_knows_the_listings() -> None:
    assert set(cli._VIEWS) == viewlink.VIEWS
    found = viewlink.scan(["--url", "u", "-v", "machines", "--json", "--keep-open", "5"])
    assert found is not None and (found.url, found.keep_open) == ("u", "5")
    assert found.prefix == ["--url", "u", "--keep-open", "5"]
    assert viewlink.scan(["--url=u", "sessions", "--keep-open=7"]).keep_open == "7"  # type: ignore[union-attr]
    for argv in (
        ["migrate"],
        ["--url", "u", "hold", "m"],
        ["--url", "a", "--url", "b", "sessions"],
    ):
        assert viewlink.scan(argv) is None, argv
    # The database names the session: another URL, another session.
    assert viewlink.Scan("a", "5").key != viewlink.Scan("b", "5").key
    assert viewlink.Scan("a", "5").key == viewlink.Scan("a", "9").key


def test_listings_through_a_session_say_what_listings_of_their_own_say(
    runtime: Path, bmdb_url: str, postgres_server: LocalPostgres
) -> None:
    seed_fleet(bmdb_url, Fleet(30))
    url = ["--url", bmdb_url]
    alone = _bmdb(runtime, *url, "machines", "--json")
    assert alone.returncode == 0, alone.stderr
    first = _bmdb(runtime, *url, "machines", "--json", "--keep-open", "60")
    assert (first.returncode, first.stdout) == (0, alone.stdout)
    _wait_for_socket(runtime)

    # Served by the session: no psycopg, Trio or views in this process.
    served = _bmdb(runtime, *url, "machines", "--json", "--keep-open", "60", importtime=True)
    assert (served.returncode, served.stdout) == (0, alone.stdout)
    modules = imported(served.stderr)
    assert "bmdb.cli.viewlink" in modules
    assert {"psycopg", "trio", "bmdb.cli.views", "bmdb.model"} & modules == set()
    assert len(alone.stdout) > 1000  # thirty machines, not an empty list

    # Errors: the same line and exit status.
    bad = _bmdb(runtime, *url, "history", "not-a-uuid", "--keep-open", "60")
    bad_alone = _bmdb(runtime, *url, "history", "not-a-uuid")
    assert (bad.returncode, bad.stdout, bad.stderr) == (1, "", bad_alone.stderr)
    assert bad.stderr.startswith("bmdb: error: not a machine id")

    # A usage error is declined: this process's parser says it.
    usage = _bmdb(runtime, *url, "machines", "--state", "nonsense", "--keep-open", "60")
    assert usage.returncode == 2 and "invalid choice" in usage.stderr

    # The session's kept connection outlives a restart of the server: the
    # next listing runs on a fresh one.
    postgres_server.stop()
    postgres_server.start()
    again = _bmdb(runtime, *url, "machines", "--json", "--keep-open", "60", importtime=True)
    assert (again.returncode, again.stdout) == (0, alone.stdout), again.stderr[-500:]
    assert "psycopg" not in imported(again.stderr)

    # A listing of another database is not this session's: it runs alone,
    # and says what that database says (here: no such database).
    other = bmdb_url.rsplit("/", 1)[0] + "/no_such_database"
    elsewhere = _bmdb(runtime, "--url", other, "sessions", "--keep-open", "60")
    assert elsewhere.returncode == 1 and "no_such_database" in elsewhere.stderr
