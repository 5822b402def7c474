"""The shared exit codes (`common.exitcodes`), per CLI: bad usage is 2, a
"not yet" is 75 (try again), a failure is 1, and every ``--help`` shows
the table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import trio

import bmdb
from bmdb import Process
from common.cli import run_main
from common.exitcodes import EPILOG, ExitCode
from metropolis import pki
from metropolis.localstorage import Root
from metropolis.proto.management import GetClusterInfoResponse
from metropolis.roleserve import disk
from metropolis.roleserve.values import RegisterIntent
from tests.bmdb.helpers import add_provided_machines, agent_start_source


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize(
    "command",
    ["bmdb", "shepherd", "shepherd install", "console", "metropolis", "shepherd.demo"],
)
def test_every_help_shows_the_table_and_bad_usage_is_2(command: str) -> None:
    shown = _run(*command.split(), "--help")
    assert shown.returncode == ExitCode.OK, shown.stderr
    assert EPILOG in shown.stdout
    bad = _run(*command.split(), "--no-such-option")
    assert bad.returncode == ExitCode.USAGE, bad.stderr


def test_bin_demo_passes_the_codes_on() -> None:
    """bin/demo execs ``python -m shepherd.demo``: its codes are the demo's."""
    text = (Path(__file__).parent.parent / "bin" / "demo").read_text()
    assert "exec .venv/bin/python -m shepherd.demo" in text


def test_run_main_maps_try_again_and_failures() -> None:
    class NotYet(Exception):
        pass

    def raises(exc: Exception) -> int:
        raise exc

    assert run_main("t", lambda: raises(NotYet("x")), known=(Exception,), try_again=(NotYet,)) == 75
    assert (
        run_main("t", lambda: raises(ValueError("x")), known=(Exception,), try_again=(NotYet,)) == 1
    )
    group = ExceptionGroup("g", [NotYet("a"), ValueError("b")])
    assert run_main("t", lambda: raises(group), known=(Exception,), try_again=(NotYet,)) == 1


def test_metropolis_owner_on_a_root_still_bootstrapping_is_try_again(tmp_path: Path) -> None:
    root = tmp_path / "n"
    settings = disk.NodeSettings(address="127.0.0.1", peer_port=1)
    disk.save_register_intent(
        Root(root), settings, RegisterIntent.generate(b"ticket", GetClusterInfoResponse())
    )
    key = tmp_path / "owner.pem"
    key.write_bytes(pki.encode_private_key(pki.generate_key()))
    result = _run("metropolis", "owner", "--root", str(root), "--owner-key", str(key), "info")
    assert result.returncode == ExitCode.TRY_AGAIN, result.stderr
    assert "is not a finished node" in result.stderr


async def test_bmdb_busy_machine_is_try_again_and_a_failure_is_1(
    bmdb_conn: bmdb.Connection, bmdb_url: str
) -> None:
    [mid] = await add_provided_machines(bmdb_conn, 1)

    async def cli(*args: str) -> int:
        done = await trio.run_process(
            [sys.executable, "-m", "bmdb", "--url", bmdb_url, *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        return done.returncode

    async with bmdb_conn.session("test-worker") as sess:
        work = await sess.work(Process.SHEPHERD_AGENT_START, agent_start_source)
        assert await cli("hold", str(mid), "--reason", "x", "--wait", "0.2") == 75
        await work.finish()
    assert await cli("hold", str(mid), "--reason", "x") == ExitCode.OK
    assert await cli("machine", "00000000-0000-0000-0000-000000000000") == ExitCode.FAILED
    assert await cli("hold", str(mid), "--reason", "again") == ExitCode.FAILED  # held already
