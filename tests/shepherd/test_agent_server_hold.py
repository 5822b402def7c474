"""The long poll: a held heartbeat is answered as soon as a request for its
machine is written, and never loses one: not when the notification is
missed, not for a heartbeat replaced by a newer one, not at the bound;
nothing is held for a client without the machine's key (issue 36, the
install benchmark)."""

from __future__ import annotations

import datetime
import functools
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

import bmdb
from bmdb import Queries
from bmdb.model import UpgradePlanEntry, UpgradeRun
from shepherd.agent import wire
from shepherd.agent.protocol import HEARTBEAT_PATH
from shepherd.agent_server.connect import ConnectUnary
from shepherd.agent_server.server import AgentServerConfig, port_of, serve_app
from shepherd.agent_server.service import HeartbeatService
from shepherd.upgrade import ask_writes, write_request
from tests.bmdb.helpers import eventually
from tests.shepherd.agents import kill_agent, start_agent_process
from tests.shepherd.helpers import provide
from tests.shepherd.test_agent_server_install import (
    Agent,
    carried,
    new_agent,
    request_bytes,
    store_request,
    stored_report,
)

#: Long enough that an answer the notification did not bring would time the
#: test out (a failure), not come in time by the hold's end.
LONG = "600000"
#: Safety bound on a wait for an answer (not a claim about speed).
WITHIN = 60.0


@dataclass
class Server:
    url: str
    service: HeartbeatService


async def _serve(conn: bmdb.Connection, nursery: trio.Nursery, **kwargs: float) -> Server:
    service = HeartbeatService(conn, **kwargs)  # type: ignore[arg-type]
    await nursery.start(service.run)
    app = ConnectUnary({HEARTBEAT_PATH: service.heartbeat})
    binds = await nursery.start(serve_app, app, AgentServerConfig(listen="127.0.0.1:0"))
    return Server(f"http://127.0.0.1:{port_of(binds[0])}", service)


@pytest.fixture
async def server(bmdb_conn: bmdb.Connection, nursery: trio.Nursery) -> AsyncIterator[Server]:
    yield await _serve(bmdb_conn, nursery, max_hold=3600.0)
    nursery.cancel_scope.cancel()


async def signed_in(conn: bmdb.Connection, server: Server) -> Agent:
    """An agent whose first (signed) heartbeat got it a session."""
    agent = await new_agent(conn, server.url)
    await agent.beat()
    return agent


async def held(server: Server, count: int) -> None:
    async def check() -> bool:
        return server.service.hold_stats.held >= count

    await eventually(check)


class Answers:
    """Heartbeats sent in the background, and their answers."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.got: dict[str, tuple[int, bytes]] = {}
        self._done: dict[str, trio.Event] = {}

    def send(self, name: str, agent: Agent, hold: str = LONG) -> None:
        self._done[name] = trio.Event()

        async def one() -> None:
            self.got[name] = await agent.post(hold=hold)
            self._done[name].set()

        self.nursery.start_soon(one)

    async def answer(self, name: str) -> tuple[int, bytes]:
        with trio.fail_after(WITHIN):
            await self._done[name].wait()
        return self.got[name]


async def test_a_request_answers_the_held_heartbeat(
    bmdb_conn: bmdb.Connection, server: Server, nursery: trio.Nursery
) -> None:
    agent = await signed_in(bmdb_conn, server)
    answers = Answers(nursery)
    answers.send("held", agent)
    await held(server, 1)
    raw = await store_request(bmdb_conn, agent.machine_id, 1)
    status, answer = await answers.answer("held")
    assert status == 200 and carried(answer) == raw
    stats = server.service.hold_stats
    assert (stats.notified, stats.timed_out, stats.superseded) == (1, 0, 0)
    # A pending request is answered at once, held or not.
    assert carried(await agent.beat(hold=LONG)) == raw


async def test_a_held_heartbeat_is_answered_empty_when_its_time_is_up(
    bmdb_conn: bmdb.Connection, server: Server
) -> None:
    agent = await signed_in(bmdb_conn, server)
    assert carried(await agent.beat(hold="200")) is None
    assert server.service.hold_stats.timed_out == 1


async def test_a_missed_notification_is_caught_up_when_listening_again(
    bmdb_conn: bmdb.Connection, server: Server, nursery: trio.Nursery
) -> None:
    """A request written without a notification (as one lost while nobody
    listened) reaches the held heartbeat once the listener listens again."""
    agent = await signed_in(bmdb_conn, server)
    answers = Answers(nursery)
    answers.send("held", agent)
    await held(server, 1)
    raw = request_bytes(1)

    async def unnotified(q: Queries) -> None:
        await q.execute(
            "INSERT INTO machine_os_installation_request"
            " (machine_id, generation, os_installation_request_raw) VALUES (%s, 1, %s)",
            (agent.machine_id, raw),
        )
        # The listener's connection ends: it listens again and catches up.
        await q.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND query LIKE 'LISTEN %%'"
        )

    await bmdb_conn.transact(unnotified)
    status, answer = await answers.answer("held")
    assert status == 200 and carried(answer) == raw
    assert server.service.hold_stats.notified == 1


async def test_an_upgrade_s_write_and_activation_answer_the_held_heartbeat(
    bmdb_conn: bmdb.Connection, server: Server, nursery: trio.Nursery
) -> None:
    """An upgrade asked of a machine (its write, or its activation) notifies
    as an installation request does; while one is carried, a heartbeat is
    answered at once with it, held or not."""
    writes = await signed_in(bmdb_conn, server)
    activated = await signed_in(bmdb_conn, server)
    answers = Answers(nursery)
    answers.send("writes", writes)
    answers.send("activated", activated)
    await held(server, 2)
    old = "sha256:" + "0" * 64
    entries = [
        UpgradePlanEntry(a.machine_id, 0, n, "disk0", old)
        for n, a in enumerate([writes, activated])
    ]

    async def start(q: Queries) -> UpgradeRun:
        run = await q.create_upgrade_run(
            image_digest="sha256:" + "e" * 64,
            os_image=b"",
            max_unavailable=1,
            health_timeout=60,
            requested_by="tester",
            machines=entries,
        )
        await ask_writes(q, run, entries[:1])
        return run

    run = await bmdb_conn.transact(start)
    status, answer = await answers.answer("writes")
    write = wire.decode_upgrade_request(answer)
    assert status == 200 and write is not None and not write.activate
    assert server.service.hold_stats.notified == 1
    assert wire.decode_upgrade_request(await writes.beat(hold=LONG)) == write  # not held
    request = write_request(run, "disk0", 1, activate=True)

    async def activate(q: Queries) -> str | None:
        return await q.request_upgrade(run.run_id, activated.machine_id, 1, request)

    assert await bmdb_conn.transact(activate) is None
    status, answer = await answers.answer("activated")
    tried = wire.decode_upgrade_request(answer)
    assert status == 200 and tried is not None and tried.activate and tried.generation == 1
    assert server.service.hold_stats.notified == 2


async def test_a_newer_heartbeat_replaces_the_held_one(
    bmdb_conn: bmdb.Connection, server: Server, nursery: trio.Nursery
) -> None:
    agent = await signed_in(bmdb_conn, server)
    answers = Answers(nursery)
    answers.send("first", agent)
    await held(server, 1)
    answers.send("second", agent)
    status, answer = await answers.answer("first")
    assert status == 200 and carried(answer) is None
    await held(server, 2)
    assert server.service.hold_stats.superseded == 1
    raw = await store_request(bmdb_conn, agent.machine_id, 1)
    status, answer = await answers.answer("second")
    assert status == 200 and carried(answer) == raw


async def test_beyond_the_bound_heartbeats_are_answered_at_once(
    bmdb_conn: bmdb.Connection, nursery: trio.Nursery
) -> None:
    server = await _serve(bmdb_conn, nursery, max_hold=3600.0, max_held=1)
    first = await signed_in(bmdb_conn, server)
    second = await signed_in(bmdb_conn, server)
    answers = Answers(nursery)
    answers.send("first", first)
    await held(server, 1)
    status, answer = await second.post(hold=LONG)
    assert status == 200 and carried(answer) is None
    assert server.service.hold_stats.not_held == 1
    raw = await store_request(bmdb_conn, first.machine_id, 1)
    assert carried((await answers.answer("first"))[1]) == raw
    nursery.cancel_scope.cancel()


async def test_a_client_without_the_key_holds_nothing_and_replaces_nothing(
    bmdb_conn: bmdb.Connection, server: Server, nursery: trio.Nursery
) -> None:
    agent = await signed_in(bmdb_conn, server)
    answers = Answers(nursery)
    answers.send("held", agent)
    await held(server, 1)
    # Signed with a key of its own, not the machine's agent's.
    stranger = Agent(server.url, agent.machine_id, bytes(32))
    status, _ = await stranger.post(hold=LONG)
    assert status == 401
    # Nor for a machine that does not exist.
    nobody = Agent(server.url, uuid.uuid4(), bytes(32))
    assert (await nobody.post(hold=LONG))[0] == 401
    raw = await store_request(bmdb_conn, agent.machine_id, 1)
    assert carried((await answers.answer("held"))[1]) == raw
    stats = server.service.hold_stats
    assert (stats.held, stats.superseded) == (1, 0)


@pytest.mark.parametrize("value", ["", "-1", "1e3", "0x10", "1" * 10, "10 0"])
async def test_a_malformed_hold_is_refused(
    bmdb_conn: bmdb.Connection, server: Server, value: str
) -> None:
    agent = await signed_in(bmdb_conn, server)
    status, answer = await agent.post(hold=value)
    assert status == 400 and b"invalid_argument" in answer and b"Hold" in answer
    assert server.service.hold_stats.held == 0


async def test_a_server_without_holds_answers_at_once(
    bmdb_conn: bmdb.Connection, nursery: trio.Nursery
) -> None:
    server = await _serve(bmdb_conn, nursery)  # max_hold 0: the default
    agent = await signed_in(bmdb_conn, server)
    status, answer = await agent.post(hold=LONG)
    assert status == 200 and carried(answer) is None
    assert server.service.hold_stats.held == 0
    nursery.cancel_scope.cancel()


async def test_a_signed_heartbeat_is_answered_at_once_with_its_session(
    bmdb_conn: bmdb.Connection, server: Server
) -> None:
    agent = await new_agent(bmdb_conn, server.url)
    status, answer = await agent.post(hold=LONG)
    assert status == 200 and carried(answer) is None
    assert wire.decode_heartbeat_session(answer) is not None
    assert server.service.hold_stats.held == 0


async def test_a_real_agent_hears_a_request_at_once(
    bmdb_conn: bmdb.Connection, server: Server, tmp_path: Path
) -> None:
    """The real agent, heartbeating every ten minutes, asks to be held: a
    request written meanwhile reaches it, and its report (a refusal: no such
    disk) comes back, long before its next heartbeat would have."""
    (mid,) = (await provide(bmdb_conn, ["m-held"])).values()
    target = tmp_path / "machine" / "agent"
    start = functools.partial(
        start_agent_process, target, str(mid), server.url, interval=600.0, cap=1.0
    )
    try:
        key = await trio.to_thread.run_sync(start)

        async def started(q: Queries) -> None:
            await q.set_agent_started(mid, datetime.datetime.now(datetime.UTC), key)

        await bmdb_conn.transact(started)
        await held(server, 1)
        await store_request(bmdb_conn, mid, 1)

        async def reported() -> bool:
            return await stored_report(bmdb_conn, mid) is not None

        await eventually(reported)
        assert server.service.hold_stats.notified == 1
    finally:
        kill_agent(target)
