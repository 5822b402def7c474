"""The fleet simulator (`bench.fleet`) against the real agent callback server and
PostgreSQL: the BMDB sees each simulated machine heartbeat with its own key."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import psycopg
import pytest

from bench.fleet import Fleet, FleetLoad, public_key, seed_fleet
from bench.heartbeat import start_servers, stop_servers

#: 12 machines, of which 0, 5 and 10 are silent, and 2 provided but not taken over.
FLEET = Fleet(12, secret="test", silent_every=5, pending=2)
HEARTBEATING = [i for i in range(FLEET.size) if not FLEET.silent(i)]


@pytest.fixture
def server_port(bmdb_url: str) -> Iterator[int]:
    """The real agent callback server (one process) on the seeded fleet."""
    seed_fleet(bmdb_url, FLEET)
    processes: list[subprocess.Popen[bytes]]
    processes, port = start_servers("full", bmdb_url, 1)
    try:
        yield port
    finally:
        stop_servers(processes)


def test_seeded_fleet_is_as_the_provisioner_and_initializer_leave_it(bmdb_url: str) -> None:
    seed_fleet(bmdb_url, FLEET)
    with psycopg.connect(bmdb_url) as conn:
        rows = conn.execute(
            """SELECT m.machine_id::text, m.agent_started, p.provider::text, p.provider_id,
                      s.agent_public_key, k.public_key IS NOT NULL,
                      (SELECT array_agg(event::text ORDER BY id) FROM work_history w
                       WHERE w.machine_id = m.machine_id)
               FROM machines m JOIN machine_provided p USING (machine_id)
               LEFT JOIN machine_agent_started s USING (machine_id)
               LEFT JOIN machine_ssh_host_key k USING (machine_id)"""
        ).fetchall()
        silent = conn.execute(
            "SELECT machine_id::text FROM machine_agent_heartbeat"
            " WHERE agent_heartbeat_at < now() - interval '30 minutes'"
        ).fetchall()
    by_id = {row[0]: row[1:] for row in rows}
    assert len(by_id) == FLEET.size + FLEET.pending
    for index in range(FLEET.size + FLEET.pending):
        started, provider, provider_id, key, host_key, history = by_id[FLEET.machine_id(index)]
        assert (provider, provider_id) == ("Static", f"fleet-{index}")
        if index < FLEET.size:
            assert started and host_key and history == ["Started", "Finished"]
            assert bytes(key) == public_key(FLEET.seed(index))
        else:
            assert not started and key is None and history is None
    keys = {bytes(row[4]) for row in rows if row[4] is not None}
    assert len(keys) == FLEET.size  # each machine its own key
    assert sorted(r[0] for r in silent) == sorted(
        FLEET.machine_id(i) for i in range(FLEET.size) if FLEET.silent(i)
    )


def test_every_agent_heartbeats_with_its_own_key(bmdb_url: str, server_port: int) -> None:
    with psycopg.connect(bmdb_url, autocommit=True) as conn:
        before = conn.execute("SELECT now()").fetchone()
    with FleetLoad(server_port, FLEET, processes=2, connections=4) as load:
        # One round: every agent's first heartbeat, signed, with its hardware report.
        up = load.phase(0.3, 0.3, drain=120)
        # Three rounds more (due at (index / 12 + k) * 0.3 s, k = 0, 1, 2), each with
        # the session the first one's answer carried.
        steady = load.phase(0.3, 0.9, drain=120)
        closed = load.phase(0, 0.3, drain=120)
    agents = len(HEARTBEATING)
    assert (up.accepted, up.signed, up.sessions, up.reports) == (agents, agents, 0, agents)
    assert (steady.accepted, steady.signed, steady.sessions) == (3 * agents, 0, 3 * agents)
    assert (up.refused, steady.refused, steady.unanswered, steady.resigned) == (0, 0, 0, 0)
    assert closed.accepted > 0 and closed.signed == 0 and closed.refused == 0
    with psycopg.connect(bmdb_url) as conn:
        fresh = conn.execute(
            "SELECT machine_id::text FROM machine_agent_heartbeat WHERE agent_heartbeat_at > %s",
            before,
        ).fetchall()
        reports: dict[str, bytes] = dict(
            conn.execute(
                "SELECT machine_id::text, hardware_report_raw FROM machine_hardware_report"
            ).fetchall()
        )
    assert sorted(r[0] for r in fresh) == sorted(FLEET.machine_id(i) for i in HEARTBEATING)
    assert sorted(reports) == sorted(FLEET.machine_id(i) for i in HEARTBEATING)
    for index in HEARTBEATING:  # each its own report, as its agent sent it
        assert f"FS{index:08d}".encode() in bytes(reports[FLEET.machine_id(index)])


def test_session_requests_are_the_agents_bytes() -> None:
    """The load's cut-once session heartbeats are byte for byte what the
    agent's header code and codec make."""
    from bench.fleet import SessionRequests
    from shepherd.agent import protocol, wire
    from shepherd.agent.heartbeat import request_headers

    machine_id = FLEET.machine_id(1)
    session = wire.AgentSession(bytes(range(32)), bytes(range(32, 64)), 3600)
    requests = SessionRequests(machine_id, session, 8443)
    for time_ns in (1, 1_796_560_974_097_670_110):
        body = wire.encode_heartbeat_request(machine_id, None)
        headers = request_headers(
            machine_id, body, time_ns, session, public_key=b"", sign=lambda m: b""
        )
        head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        expected = (
            f"POST {protocol.HEARTBEAT_PATH} HTTP/1.1\r\nHost: 127.0.0.1:8443\r\n"
            f"Accept-Encoding: identity\r\nContent-Length: {len(body)}\r\n{head}\r\n"
        ).encode() + body
        assert requests.request(time_ns) == expected
