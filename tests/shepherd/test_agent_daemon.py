"""The detached agent: it trusts only the CA it was given, and a new takeover replaces it."""

from __future__ import annotations

import datetime
import subprocess
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

import bmdb
from bmdb import Queries
from shepherd.agent import wire
from shepherd.agent_bundle import agent_zipapp
from shepherd.agent_server import AgentServerConfig, run_agent_server
from shepherd.agent_server.server import port_of
from shepherd.localfleet import agent_pid
from shepherd.proto import agent as bp
from tests.shepherd.agents import kill_agent, make_tls, start_agent_process
from tests.shepherd.helpers import provide


@pytest.fixture
async def tls_endpoint(
    bmdb_conn: bmdb.Connection, tmp_path: Path, nursery: trio.Nursery
) -> AsyncIterator[str]:
    tls = make_tls(tmp_path / "tls")
    config = AgentServerConfig(listen="127.0.0.1:0", certfile=tls.certfile, keyfile=tls.keyfile)
    binds = await nursery.start(
        lambda task_status: run_agent_server(bmdb_conn, config, task_status=task_status)
    )
    yield f"https://127.0.0.1:{port_of(binds[0])}"
    nursery.cancel_scope.cancel()


async def _start(conn: bmdb.Connection, target: Path, endpoint: str, ca: bytes) -> uuid.UUID:
    (mid,) = (await provide(conn, [f"m-{uuid.uuid4()}"])).values()
    key = await trio.to_thread.run_sync(
        lambda: start_agent_process(target, str(mid), endpoint, interval=0.3, cap=1.0, ca=ca)
    )

    async def record(q: Queries) -> None:
        await q.set_agent_started(mid, datetime.datetime.now(datetime.UTC), key)

    await conn.transact(record)
    return mid


async def _heartbeat(conn: bmdb.Connection, mid: uuid.UUID) -> datetime.datetime | None:
    async def read(q: Queries) -> datetime.datetime | None:
        return await q.agent_heartbeat(mid)

    return await conn.transact(read)


async def test_agent_refuses_a_server_its_ca_did_not_sign(
    bmdb_conn: bmdb.Connection, tls_endpoint: str, tmp_path: Path
) -> None:
    good, bad = tmp_path / "good" / "agent", tmp_path / "bad" / "agent"
    other_ca = make_tls(tmp_path / "other").ca_der
    right_ca = (tmp_path / "tls" / "ca.der").read_bytes()
    try:
        trusting = await _start(bmdb_conn, good, tls_endpoint, right_ca)
        mistrusting = await _start(bmdb_conn, bad, tls_endpoint, other_ca)
        with trio.fail_after(60):
            while await _heartbeat(bmdb_conn, trusting) is None:  # noqa: ASYNC110 (in Postgres)
                await trio.sleep(0.1)
        # The agent given another CA never gets through, and says why.
        log = bad.with_name("agent.log")
        with trio.fail_after(60):
            while "CERTIFICATE_VERIFY_FAILED" not in await trio.Path(log).read_text():  # noqa: ASYNC110
                await trio.sleep(0.1)
        assert await _heartbeat(bmdb_conn, mistrusting) is None
        assert agent_pid(bad) is not None  # still trying, with backoff
    finally:
        kill_agent(good)
        kill_agent(bad)


async def test_new_takeover_replaces_the_running_agent(
    bmdb_conn: bmdb.Connection, tls_endpoint: str, tmp_path: Path
) -> None:
    target = tmp_path / "machine" / "agent"
    ca = (tmp_path / "tls" / "ca.der").read_bytes()
    try:
        await _start(bmdb_conn, target, tls_endpoint, ca)
        first = agent_pid(target)
        assert first is not None
        await _start(bmdb_conn, target, tls_endpoint, ca)
        second = agent_pid(target)
        assert second is not None and second != first
        with trio.fail_after(30):
            while _alive(first):  # noqa: ASYNC110 (another process)
                await trio.sleep(0.05)
    finally:
        kill_agent(target)


def _alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (its parent, init here, may reap it late)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return state != b"Z"


def test_unusable_ca_certificate_is_a_takeover_error(tmp_path: Path) -> None:
    """The agent answers with a TakeoverError (and does not detach) when it
    could not heartbeat anyway."""
    target = tmp_path / "agent"
    target.write_bytes(agent_zipapp())
    init = wire.TakeoverInit(str(uuid.uuid4()), "https://127.0.0.1:1", b"0\x82 not DER")
    done = subprocess.run(
        ["/usr/bin/python3", "-I", "-S", str(target), "--heartbeat-interval", "1"],
        input=init.encode(),
        capture_output=True,
        check=True,
        timeout=60,
    )
    response = bp.TakeoverResponse.parse(done.stdout)
    assert response.error is not None
    assert "cannot use ca_certificate" in response.error.message
    assert agent_pid(target) is None
