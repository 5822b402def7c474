"""The installation flow through the agent callback server (issue 25), against a real BMDB.

A machine with a stored OS installation request gets it in every heartbeat
answer until a report of that generation is stored; reports are stored only
for the generation requested, with an error's cause made printable.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
import trio

import bmdb
from bmdb import Isolation, Queries
from bmdb.actions import act
from bmdb.model import InstallState, OSInstallation
from common.protobuf import parse_checked
from common.text import printable
from shepherd.agent import ed25519, protocol, wire
from shepherd.agent_server import AgentServerConfig, run_agent_server
from shepherd.agent_server.server import port_of
from shepherd.proto.agent_callback import (
    HeartbeatRequest,
    HeartbeatResponse,
    MetropolisInstallationRequest,
    OsInstallationReport,
    OsInstallationReportError,
    OsInstallationReportSuccess,
    OsInstallationRequest,
)
from tests.shepherd.helpers import provide


@pytest.fixture
async def url(bmdb_conn: bmdb.Connection, nursery: trio.Nursery) -> AsyncIterator[str]:
    config = AgentServerConfig(listen="127.0.0.1:0")
    binds = await nursery.start(
        lambda task_status: run_agent_server(bmdb_conn, config, task_status=task_status)
    )
    yield f"http://127.0.0.1:{port_of(binds[0])}"
    nursery.cancel_scope.cancel()


@dataclass
class Agent:
    """A machine's agent as the server sees it: signs its first heartbeat, then MACs."""

    url: str
    machine_id: uuid.UUID
    seed: bytes
    session: wire.AgentSession | None = None
    last_ns: int = 0

    async def post(
        self, report: OsInstallationReport | None = None, *, hold: str | None = None
    ) -> tuple[int, bytes]:
        """One heartbeat; ``hold``: the value of its `protocol.HEADER_HOLD`, if any."""
        body = bytes(HeartbeatRequest(machine_id=str(self.machine_id), installation_report=report))
        now = max(time.time_ns(), self.last_ns + 1)
        self.last_ns = now
        message = protocol.signed_message(
            "POST", protocol.HEARTBEAT_PATH, str(self.machine_id), now, body
        )
        headers = {"Content-Type": "application/proto", protocol.HEADER_TIME: str(now)}
        if self.session is None:
            signature = ed25519.ed25519_sign(self.seed, message)
            headers[protocol.HEADER_KEY] = base64.b64encode(
                ed25519.ed25519_public_key(self.seed)
            ).decode()
            headers[protocol.HEADER_SIGNATURE] = base64.b64encode(signature).decode()
        else:
            headers[protocol.HEADER_SESSION] = base64.b64encode(self.session.token).decode()
            mac = protocol.session_mac(self.session.key, message)
            headers[protocol.HEADER_MAC] = base64.b64encode(mac).decode()
        if hold is not None:
            headers[protocol.HEADER_HOLD] = hold
        async with httpx.AsyncClient(timeout=None if hold is not None else 5.0) as client:
            response = await client.post(
                self.url + protocol.HEARTBEAT_PATH, content=body, headers=headers
            )
        return response.status_code, response.content

    async def beat(
        self, report: OsInstallationReport | None = None, *, hold: str | None = None
    ) -> bytes:
        """One accepted heartbeat's answer (the session it carries is kept)."""
        status, answer = await self.post(report, hold=hold)
        assert status == 200, answer
        session = wire.decode_heartbeat_session(answer)
        if session is not None:
            self.session = session
        return answer


async def new_agent(conn: bmdb.Connection, url: str) -> Agent:
    (mid,) = (await provide(conn, [f"m-{uuid.uuid4()}"])).values()
    seed = os.urandom(32)

    async def start(q: Queries) -> None:
        now = datetime.datetime.now(datetime.UTC)
        await q.set_agent_started(mid, now, ed25519.ed25519_public_key(seed))

    await conn.transact(start)
    return Agent(url, mid, seed)


def request_bytes(generation: int, root: str = "disk0") -> bytes:
    return bytes(
        OsInstallationRequest(
            generation=generation,
            metropolis=MetropolisInstallationRequest(
                node_parameters=b"\x0a\x02pp", root_device=root, os_image=b"\x0a\x05https"
            ),
        )
    )


async def store_request(conn: bmdb.Connection, mid: uuid.UUID, generation: int) -> bytes:
    raw = request_bytes(generation, root=f"disk-{generation}")

    async def put(q: Queries) -> None:
        await q.set_os_installation_request(mid, generation, raw)

    await conn.transact(put)
    return raw


async def stored_report(conn: bmdb.Connection, mid: uuid.UUID) -> tuple[int, bytes] | None:
    async def read(q: Queries) -> tuple[int, bytes] | None:
        rows = await q.execute(
            "SELECT generation, os_installation_report_raw FROM machine_os_installation_report"
            " WHERE machine_id = %s",
            (mid,),
        )
        return (rows[0][0], bytes(rows[0][1])) if rows else None

    return await conn.transact(read, isolation=Isolation.READ_COMMITTED)


def carried(answer: bytes) -> bytes | None:
    """The installation request an answer carries, decoded by the agent's codec and by
    the generated classes (which must agree)."""
    by_agent = [
        value
        for number, wire_type, value in wire.iter_fields(answer)
        if number == 1 and wire_type == wire.WIRE_LEN
    ]
    parsed = parse_checked(HeartbeatResponse, answer)
    if parsed.installation_request is None:
        assert by_agent == []
        return None
    assert by_agent == [bytes(parsed.installation_request)]
    assert isinstance(by_agent[0], bytes)
    return by_agent[0]


def success(generation: int, key: bytes) -> OsInstallationReport:
    return OsInstallationReport(
        generation=generation, success=OsInstallationReportSuccess(node_public_key=key)
    )


def failure(generation: int, cause: str) -> OsInstallationReport:
    return OsInstallationReport(generation=generation, error=OsInstallationReportError(error=cause))


async def test_request_is_carried_until_its_report_is_stored(
    bmdb_conn: bmdb.Connection, url: str
) -> None:
    agent = await new_agent(bmdb_conn, url)
    assert carried(await agent.beat()) is None  # nothing requested yet
    raw = await store_request(bmdb_conn, agent.machine_id, 1)

    first = await agent.beat()  # MACed (session from the first beat)
    assert carried(first) == raw
    parsed = parse_checked(HeartbeatResponse, first).installation_request
    assert parsed is not None and parsed.generation == 1
    assert parsed.metropolis is not None and parsed.metropolis.root_device == "disk-1"

    agent.session = None  # a signed heartbeat: the request beside a new session
    signed = await agent.beat()
    assert carried(signed) == raw
    assert wire.decode_heartbeat_session(signed) is not None

    key = bytes(range(32))
    answer = await agent.beat(success(1, key))
    assert carried(answer) is None  # the report's own answer already has no request
    assert carried(await agent.beat()) is None
    stored = await stored_report(bmdb_conn, agent.machine_id)
    assert stored is not None and stored[0] == 1
    report = parse_checked(OsInstallationReport, stored[1])
    assert report.success is not None and report.success.node_public_key == key

    raw2 = await store_request(bmdb_conn, agent.machine_id, 2)  # a new generation
    assert carried(await agent.beat()) == raw2


async def test_report_of_another_generation_is_ignored(
    bmdb_conn: bmdb.Connection, url: str
) -> None:
    agent = await new_agent(bmdb_conn, url)
    raw = await store_request(bmdb_conn, agent.machine_id, 2)
    for generation in (1, 3):
        answer = await agent.beat(success(generation, bytes(32)))
        assert carried(answer) == raw
    assert await stored_report(bmdb_conn, agent.machine_id) is None
    assert carried(await agent.beat(failure(2, "no"))) is None
    stored = await stored_report(bmdb_conn, agent.machine_id)
    assert stored is not None and stored[0] == 2
    # Reported already: a repeat (an agent that missed the answer) changes nothing.
    await agent.beat(success(2, bytes(32)))
    assert await stored_report(bmdb_conn, agent.machine_id) == stored


async def test_error_cause_is_stored_escaped(bmdb_conn: bmdb.Connection, url: str) -> None:
    agent = await new_agent(bmdb_conn, url)
    await store_request(bmdb_conn, agent.machine_id, 1)
    cause = "disk gone\x1b[2J\r\nINFO forged log line\u202e"
    await agent.beat(failure(1, cause))
    stored = await stored_report(bmdb_conn, agent.machine_id)
    assert stored is not None
    report = parse_checked(OsInstallationReport, stored[1])
    assert report.error is not None
    assert report.error.error == printable(cause)
    assert "\x1b" not in report.error.error and "\n" not in report.error.error


@pytest.mark.parametrize(
    "report",
    [
        OsInstallationReport(generation=1),  # no result
        success(0, bytes(32)),  # generation not positive
        success(-1, bytes(32)),
        success(1, bytes(31)),  # not an Ed25519 key
    ],
    ids=["no-result", "generation-0", "generation-negative", "short-key"],
)
async def test_malformed_report_refuses_the_heartbeat(
    bmdb_conn: bmdb.Connection, url: str, report: OsInstallationReport
) -> None:
    agent = await new_agent(bmdb_conn, url)
    await store_request(bmdb_conn, agent.machine_id, 1)
    status, answer = await agent.post(report)
    assert (status, json.loads(answer)["code"]) == (400, "invalid_argument")
    assert await stored_report(bmdb_conn, agent.machine_id) is None

    async def beat_at(q: Queries) -> object:
        return await q.agent_heartbeat(agent.machine_id)

    assert await bmdb_conn.transact(beat_at) is None


async def test_each_agent_of_a_group_gets_its_own_request(
    bmdb_conn: bmdb.Connection, url: str
) -> None:
    agents = [await new_agent(bmdb_conn, url) for _ in range(8)]
    for agent in agents:
        await agent.beat()  # sessions
    raws: dict[uuid.UUID, bytes | None] = {}
    for index, agent in enumerate(agents):
        raws[agent.machine_id] = (
            await store_request(bmdb_conn, agent.machine_id, index + 1) if index % 2 else None
        )
    answers: dict[uuid.UUID, bytes] = {}

    async def beat(agent: Agent) -> None:
        answers[agent.machine_id] = await agent.beat()

    async with trio.open_nursery() as nursery:  # concurrent: written as groups
        for agent in agents:
            nursery.start_soon(beat, agent)
    assert {mid: carried(answer) for mid, answer in answers.items()} == raws


async def test_a_request_the_agent_could_not_read_is_refused_not_carried(
    bmdb_conn: bmdb.Connection, url: str
) -> None:
    """A stored request the agent would ignore (too large, not decoding, of
    another generation than the row's) is not carried: the server stores an
    error report on the row's generation, which the views show."""
    from shepherd.agent_server.reports import MAX_CARRIED_REQUEST, request_refusal

    agent = await new_agent(bmdb_conn, url)
    await agent.beat()
    mismatched = request_bytes(7, root="disk0")

    async def put(q: Queries) -> None:
        await q.set_os_installation_request(agent.machine_id, 1, mismatched)

    await bmdb_conn.transact(put)
    assert carried(await agent.beat()) is None
    stored = await stored_report(bmdb_conn, agent.machine_id)
    assert stored is not None and stored[0] == 1
    report = parse_checked(OsInstallationReport, stored[1])
    assert report.error is not None
    assert report.error.error == (
        "refused by the agent callback server, not sent to the agent: "
        "request names generation 7, the BMDB requests 1"
    )
    # A new, well-formed generation is carried again.
    raw = await store_request(bmdb_conn, agent.machine_id, 2)
    assert carried(await agent.beat()) == raw

    assert request_refusal(request_bytes(3, root="disk0"), 3) is None
    assert request_refusal(b"x" * (MAX_CARRIED_REQUEST + 1), 1) == (
        f"request of {MAX_CARRIED_REQUEST + 1} bytes, over the bound of {MAX_CARRIED_REQUEST}"
    )
    cut = request_refusal(request_bytes(1, root="disk0")[:-1], 1)
    assert cut is not None and cut.startswith("request does not decode: ")


async def test_a_decommissioning_machine_is_carried_no_request(
    bmdb_conn: bmdb.Connection, url: str
) -> None:
    """Once an operator asks to decommission a machine, its pending request
    no longer reaches its agent (another machine's still does); a report on
    that generation is still stored, so the decommissioner learns of the node
    an install already under way started."""
    leaving, staying = await new_agent(bmdb_conn, url), await new_agent(bmdb_conn, url)
    raw = await store_request(bmdb_conn, leaving.machine_id, 1)
    other = await store_request(bmdb_conn, staying.machine_id, 1)
    assert carried(await leaving.beat()) == raw
    await act(bmdb_conn, "decommission", leaving.machine_id, operator="op", reason="retire")
    for _ in range(2):  # MACed, then signed (a new session)
        assert carried(await leaving.beat()) is None
        leaving.session = None
    assert carried(await staying.beat()) == other
    assert await stored_report(bmdb_conn, leaving.machine_id) is None  # pending, not carried
    key = bytes(range(32))
    assert carried(await leaving.beat(success(1, key))) is None
    stored = await stored_report(bmdb_conn, leaving.machine_id)
    assert stored is not None and stored[0] == 1


async def test_what_the_agent_finds_of_its_install_later_is_stored_beside_the_report(
    bmdb_conn: bmdb.Connection, url: str
) -> None:
    """Unasked reports on the installed generation (an agent back after a
    reboot, a disk emptied behind its back): stored as a check when they are
    of that generation's node, ignored otherwise; the report stays."""
    agent = await new_agent(bmdb_conn, url)
    await store_request(bmdb_conn, agent.machine_id, 1)
    key = bytes(range(32))
    await agent.beat(success(1, key))
    stored = await stored_report(bmdb_conn, agent.machine_id)

    async def installation() -> OSInstallation:
        got = await bmdb_conn.transact(lambda q: q.os_installation(agent.machine_id))
        assert got is not None
        return got

    await agent.beat(success(1, bytes(32)))  # another node's key: ignored
    await agent.beat(failure(2, "gone"))  # not its generation: ignored
    got = await installation()
    assert (got.state, got.checked_at) == (InstallState.INSTALLED, None)
    await agent.beat(success(1, key))  # back after a reboot, still there
    got = await installation()
    assert got.state is InstallState.INSTALLED and got.checked_at is not None
    cause = "generation 1 is gone from /dev/sdb: /dev/sdb holds no boot record\x1b[2J"
    await agent.beat(failure(1, cause))
    got = await installation()
    assert got.state is InstallState.INSTALL_LOST and got.lost_cause == printable(cause)
    assert got.node_public_key == key
    assert await stored_report(bmdb_conn, agent.machine_id) == stored  # the report itself stays
