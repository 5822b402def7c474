"""The initializer end to end: BMDB, control loop, real SSH servers, the real agent."""

from __future__ import annotations

import base64
import re
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import bmdb
from bmdb import Backoff, Isolation, Queries, WorkEvent
from shepherd.agent_bundle import agent_zipapp
from shepherd.agent_start import AgentConfig
from shepherd.control_loop import start_control_loop
from shepherd.initializer import DEFAULT_BACKOFF, Initializer
from shepherd.localfleet import open_fleet
from shepherd.localsshd import Sshd, start_sshd, stop_sshd
from shepherd.providers import Machine
from shepherd.providers.static import StaticProvider
from shepherd.rate_limit import Rate, RateLimiter
from shepherd.ssh import SSHClient
from shepherd.ssh_key import SSHKey
from tests.shepherd.agents import patched_agent
from tests.shepherd.helpers import (
    agent_keys,
    backoffs,
    events,
    host_key_of,
    provide,
    settled,
)

ENDPOINT = "bmaas.example:443"
CA_DER = b"0\x82\x01\x00 not really DER, passed through as bytes"


def agent_config(target: Path | str, executable: bytes, exec_timeout: float = 30.0) -> AgentConfig:
    return AgentConfig(
        executable=executable,
        target_path=str(target),
        endpoint=ENDPOINT,
        endpoint_ca_certificate=CA_DER,
        ssh_connect_timeout=5.0,
        ssh_exec_timeout=exec_timeout,
    )


@dataclass
class LoopRun:
    conn: bmdb.Connection
    initializer: Initializer
    parallelism: int = 2
    # Long enough that a CPU-starved test machine does not expire sessions
    # (which would, correctly, re-run agents and break "exactly once").
    session_interval: float = 10.0

    async def until(self, done: Callable[[], Awaitable[bool]]) -> None:
        """Run the control loop until ``done()``, then cancel it."""
        async with trio.open_nursery() as nursery:
            start_control_loop(
                nursery,
                self.conn,
                self.initializer,
                parallelism=self.parallelism,
                limiter=RateLimiter(Rate(0.005, 8)),
                session_interval=self.session_interval,
            )
            # A bound for a hung loop, not a performance claim: 100 SSH
            # takeovers took ~80 s on a 2-core machine under a load of 15.
            with trio.fail_after(300):
                while not await done():  # noqa: ASYNC110 (the state is in Postgres)
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()


def test_default_backoff_is_the_seeds() -> None:
    # 5 minutes, growing by x1.2 up to 4 hours.
    assert Backoff(initial=5 * 60, maximum=4 * 3600, exponent=1.2) == DEFAULT_BACKOFF
    assert DEFAULT_BACKOFF.next() == 300
    assert DEFAULT_BACKOFF.next(300) == 360
    assert DEFAULT_BACKOFF.next(14000) == 4 * 3600


def _public_key_of_seed_file(path: Path) -> bytes:
    return (
        Ed25519PrivateKey.from_private_bytes(path.read_bytes())
        .public_key()
        .public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    )


async def test_end_to_end_on_openssh(
    aio_loop: object, bmdb_conn: bmdb.Connection, sshd: Sshd, shepherd_ssh_key: SSHKey
) -> None:
    ids = await provide(bmdb_conn, ["m-1"])
    mid = ids["m-1"]
    provider = StaticProvider([Machine("m-1", sshd.host, sshd.port)])
    ssh = SSHClient(shepherd_ssh_key, username="root", connect_timeout=5.0)
    config = agent_config(sshd.root / "agent", agent_zipapp())
    run = LoopRun(bmdb_conn, Initializer(provider, ssh, config))

    await run.until(lambda: settled(bmdb_conn, [mid]))

    assert await events(bmdb_conn, mid) == [(WorkEvent.STARTED, ""), (WorkEvent.FINISHED, "")]
    # The key in the BMDB is the one the uploaded agent created beside itself.
    keys = await agent_keys(bmdb_conn)
    assert keys == {mid: _public_key_of_seed_file(sshd.root / "agent.key")}
    assert await host_key_of(bmdb_conn, mid) == sshd.host_key
    assert await backoffs(bmdb_conn) == {}

    async def leftovers(q: Queries) -> tuple[int, int]:
        return len(await q.work()), len(await q.sessions())

    assert await bmdb_conn.transact(leftovers) == (0, 0)


# Broken agents: each is uploaded to two machines; both must fail with the
# cause, get the initializer's backoff, and the loop must go on to the second.
HANG = b"#!/bin/sh\n# Never answers; dies of SIGPIPE once the session is gone.\n"
HANG += b"while sleep 0.1; do printf .; done\n"
GARBAGE = b"#!/bin/sh\ncat >/dev/null\necho 'I am not protobuf at all'\n"
EXIT_7 = b"#!/bin/sh\ncat >/dev/null\necho boom >&2\nexit 7\n"
FLOOD = b"#!/bin/sh\ncat >/dev/null\nexec cat /dev/zero\n"
# The real agent with one bug injected each.
SCRIPT = agent_zipapp()
SHORT_KEY = patched_agent(
    "__main__.py", b"ed25519_public_key(seed), warnings)", b"b'short', warnings)"
)
# (Another machine id of the same length: "+" for each "-" of the UUID.)
WRONG_ECHO = patched_agent(
    "__main__.py",
    b"encode_success(init_bytes,",
    b"encode_success(init_bytes.replace(b'-', b'+'),",
)


@pytest.mark.parametrize(
    ("agent", "broken_key_file", "exec_timeout", "cause"),
    [
        (GARBAGE, False, 30, "agent reply is not a TakeoverResponse"),
        (WRONG_ECHO, False, 30, "agent did not echo the init message"),
        (SHORT_KEY, False, 30, "agent key is 5 bytes, want 32"),
        (EXIT_7, False, 30, "agent exited with status 7: stderr 'boom'"),
        (FLOOD, False, 30, "running the agent failed: .*stdout exceeds 1048576 bytes"),
        (SCRIPT, True, 30, "agent returned error: key file .* holds 7 bytes, want 32"),
        (HANG, False, 3, "timed out after 3s while uploading or running the agent"),
    ],
    ids=["garbage", "wrong-echo", "short-key", "exit-status", "flood", "agent-error", "hang"],
)
async def test_broken_agent_fails_machines_with_cause_and_backoff(
    aio_loop: object,
    bmdb_conn: bmdb.Connection,
    sshd: Sshd,
    shepherd_ssh_key: SSHKey,
    agent: bytes,
    broken_key_file: bool,
    exec_timeout: float,
    cause: str,
) -> None:
    if broken_key_file:
        (sshd.root / "agent.key").write_bytes(b"garbage")
    ids = await provide(bmdb_conn, ["m-1", "m-2"])
    provider = StaticProvider([Machine(p, sshd.host, sshd.port) for p in ids])
    ssh = SSHClient(shepherd_ssh_key, username="root", connect_timeout=5.0)
    config = agent_config(sshd.root / "agent", agent, exec_timeout)
    run = LoopRun(bmdb_conn, Initializer(provider, ssh, config))

    await run.until(lambda: settled(bmdb_conn, list(ids.values())))

    backoff = await backoffs(bmdb_conn)
    for mid in ids.values():
        history = await events(bmdb_conn, mid)
        assert [e for e, _ in history] == [WorkEvent.STARTED, WorkEvent.FAILED]
        assert re.search(cause, history[1][1]), history[1][1]
        assert backoff[mid][0] == DEFAULT_BACKOFF.next()
        assert backoff[mid][1] == history[1][1]
        # Trust on first use applies even when the takeover failed.
        assert await host_key_of(bmdb_conn, mid) == sshd.host_key
    assert await agent_keys(bmdb_conn) == {}


async def test_unreachable_unauthorized_and_impostor_machines_fail_others_start(
    aio_loop: object,
    bmdb_conn: bmdb.Connection,
    sshd: Sshd,
    shepherd_ssh_key: SSHKey,
    tmp_path: Path,
) -> None:
    closed = trio.socket.socket()
    await closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    other_process, other_sshd = start_sshd(tmp_path / "other", [SSHKey.generate().authorized_key])
    try:
        ids = await provide(
            bmdb_conn, ["good", "closed", "wrong-key", "impostor", "no-address", "ghost"]
        )
        impostor_key = SSHKey.generate().authorized_key.split()[1]

        async def record(q: Queries) -> None:
            await q.set_ssh_host_key(ids["impostor"], base64.b64decode(impostor_key))

        await bmdb_conn.transact(record)
        provider = StaticProvider(
            [
                Machine("good", sshd.host, sshd.port),
                Machine("closed", "127.0.0.1", closed_port),
                Machine("wrong-key", other_sshd.host, other_sshd.port),
                Machine("impostor", sshd.host, sshd.port),
                Machine("no-address", None),
                # "ghost" is in the BMDB but the provider does not know it.
            ]
        )
        ssh = SSHClient(shepherd_ssh_key, username="root", connect_timeout=5.0)
        config = agent_config(sshd.root / "agent", agent_zipapp())
        run = LoopRun(bmdb_conn, Initializer(provider, ssh, config), parallelism=3)
        await run.until(lambda: settled(bmdb_conn, list(ids.values())))
    finally:
        stop_sshd(other_process)

    expected = {
        "closed": f"SSH dial failed: cannot connect to 127.0.0.1:{closed_port}",
        "wrong-key": "SSH dial failed: .* refused our key for user 'root'",
        "impostor": "SSH host key changed: .* does not hold the recorded host key "
        r"\(it presented ssh-ed25519 key SHA256:",
        "no-address": "machine has no address",
        "ghost": "failed to fetch machine from provider: static provider has no machine 'ghost'",
    }
    backoff = await backoffs(bmdb_conn)
    for pid, cause in expected.items():
        history = await events(bmdb_conn, ids[pid])
        assert [e for e, _ in history] == [WorkEvent.STARTED, WorkEvent.FAILED], pid
        assert re.search(cause, history[1][1]), (pid, history[1][1])
        assert backoff[ids[pid]] == (DEFAULT_BACKOFF.next(), history[1][1])
    assert await events(bmdb_conn, ids["good"]) == [
        (WorkEvent.STARTED, ""),
        (WorkEvent.FINISHED, ""),
    ]
    assert list(await agent_keys(bmdb_conn)) == [ids["good"]]
    # The impostor's key did not replace the recorded one; the unauthorized
    # server completed the handshake (proving it holds its key) before
    # refusing ours, so its key is recorded: a later impostor is refused.
    assert await host_key_of(bmdb_conn, ids["impostor"]) == base64.b64decode(impostor_key)
    assert await host_key_of(bmdb_conn, ids["wrong-key"]) == other_sshd.host_key


async def test_cancelling_the_loop_leaves_nothing_locked(
    aio_loop: object, bmdb_conn: bmdb.Connection, sshd: Sshd, shepherd_ssh_key: SSHKey
) -> None:
    ids = await provide(bmdb_conn, ["m-1"])
    mid = ids["m-1"]
    provider = StaticProvider([Machine("m-1", sshd.host, sshd.port)])
    ssh = SSHClient(shepherd_ssh_key, username="root", connect_timeout=5.0)
    config = agent_config(sshd.root / "agent", HANG, exec_timeout=60)
    run = LoopRun(bmdb_conn, Initializer(provider, ssh, config))

    async def agent_running() -> bool:
        # The agent writes its dots only once it runs.
        return (sshd.root / "agent").exists() and bool(await events(bmdb_conn, mid))

    await run.until(agent_running)

    assert [e for e, _ in await events(bmdb_conn, mid)] == [
        WorkEvent.STARTED,
        WorkEvent.CANCELED,
    ]

    async def leftovers(q: Queries) -> tuple[int, int]:
        return len(await q.work()), len(await q.sessions())

    assert await bmdb_conn.transact(leftovers) == (0, 0)
    assert await backoffs(bmdb_conn) == {}


async def test_worker_replaces_an_expired_session(
    aio_loop: object, bmdb_conn: bmdb.Connection, sshd: Sshd, shepherd_ssh_key: SSHKey
) -> None:
    provider = StaticProvider([Machine("m-1", sshd.host, sshd.port)])
    ssh = SSHClient(shepherd_ssh_key, username="root", connect_timeout=5.0)
    config = agent_config(sshd.root / "agent", agent_zipapp())
    run = LoopRun(
        bmdb_conn, Initializer(provider, ssh, config), parallelism=1, session_interval=2.0
    )
    first: list[uuid.UUID] = []
    ids: dict[str, uuid.UUID] = {}

    async def session_ids(q: Queries) -> list[uuid.UUID]:
        return [s.session_id for s in await q.sessions()]

    async def progress() -> bool:
        sessions = await bmdb_conn.transact(session_ids)
        if not first:
            if sessions:
                # Kill the worker's session behind its back, as an expiry
                # (or an operator) would, then give it a machine.
                first.extend(sessions)

                async def kill(q: Queries) -> None:
                    await q.execute("DELETE FROM sessions")

                await bmdb_conn.transact(kill, isolation=Isolation.READ_COMMITTED)
                ids.update(await provide(bmdb_conn, ["m-1"]))
            return False
        return await settled(bmdb_conn, list(ids.values()))

    await run.until(progress)

    history = await bmdb_conn.transact(lambda q: q.history(ids["m-1"]))
    assert [h.event for h in history] == [WorkEvent.STARTED, WorkEvent.FINISHED]
    assert history[0].session_id not in first


async def test_hundred_machines_started_exactly_once(
    aio_loop: object, bmdb_conn: bmdb.Connection, shepherd_ssh_key: SSHKey, tmp_path: Path
) -> None:
    count = 100
    async with open_fleet(
        tmp_path, count=count, authorized_key=shepherd_ssh_key.authorized_key
    ) as f:
        ids = await provide(bmdb_conn, [f"m-{i}" for i in range(count)])
        provider = StaticProvider(
            [Machine(f"m-{i}", m.host, m.port) for i, m in enumerate(f.machines)]
        )
        ssh = SSHClient(shepherd_ssh_key, username="root", connect_timeout=10.0)
        config = agent_config("/agent", agent_zipapp(), exec_timeout=60)
        run = LoopRun(bmdb_conn, Initializer(provider, ssh, config), parallelism=8)

        async def all_started() -> bool:
            return len(await agent_keys(bmdb_conn)) == count

        await run.until(all_started)

        assert [m.execs for m in f.machines] == [1] * count
        keys = await agent_keys(bmdb_conn)
        for i, machine in enumerate(f.machines):
            mid = ids[f"m-{i}"]
            assert await events(bmdb_conn, mid) == [
                (WorkEvent.STARTED, ""),
                (WorkEvent.FINISHED, ""),
            ]
            assert keys[mid] == _public_key_of_seed_file(machine.root / "agent.key")
            assert await host_key_of(bmdb_conn, mid) == machine.host_key


async def test_success_never_overwrites_a_host_key_recorded_meanwhile(
    aio_loop: object, bmdb_conn: bmdb.Connection, sshd: Sshd, shepherd_ssh_key: SSHKey
) -> None:
    """A worker sourced the machine with no key recorded; another process
    recorded one before the takeover succeeded. That record stands."""
    ids = await provide(bmdb_conn, ["m-1"])
    mid = ids["m-1"]
    provider = StaticProvider([Machine("m-1", sshd.host, sshd.port)])
    ssh = SSHClient(shepherd_ssh_key, username="root", connect_timeout=5.0)
    initializer = Initializer(provider, ssh, agent_config(sshd.root / "agent", agent_zipapp()))
    # The recorded key is the server's own (a recoverer saw the same machine),
    # stored with a different first_seen; an overwrite would be an UPDATE.
    async with bmdb_conn.session("test", "here") as session:
        tasks = []

        async def source(q: Queries) -> list[uuid.UUID]:
            task = await initializer.source(q)
            assert task is not None and task.known_host_key is None
            tasks.append(task)
            return [task.machine.machine_id]

        work = await session.work(initializer.process, source)
        other = base64.b64decode(SSHKey.generate().authorized_key.split()[1])

        async def record(q: Queries) -> None:
            await q.set_ssh_host_key(mid, other)

        await bmdb_conn.transact(record)
        await initializer.handle(work, tasks[0])
    assert await host_key_of(bmdb_conn, mid) == other
    assert list(await agent_keys(bmdb_conn)) == [mid]


# An agent that answers with a huge error full of terminal escapes and a
# forged log line.
HOSTILE_ERROR = patched_agent(
    "__main__.py",
    b"seed = load_or_create_seed(key_file, warnings)",
    b"raise AgentError('\\x1b[2J\\x1b[31mred\\nFAKE LOG LINE\\u202e' + 'A' * 5000)",
)


async def test_machine_text_is_bounded_and_escaped_in_history(
    aio_loop: object,
    bmdb_conn: bmdb.Connection,
    bmdb_url: str,
    sshd: Sshd,
    shepherd_ssh_key: SSHKey,
) -> None:
    ids = await provide(bmdb_conn, ["m-1"])
    mid = ids["m-1"]
    provider = StaticProvider([Machine("m-1", sshd.host, sshd.port)])
    ssh = SSHClient(shepherd_ssh_key, username="root", connect_timeout=5.0)
    config = agent_config(sshd.root / "agent", HOSTILE_ERROR)
    await LoopRun(bmdb_conn, Initializer(provider, ssh, config)).until(
        lambda: settled(bmdb_conn, [mid])
    )
    [(_, _), (event, cause)] = await events(bmdb_conn, mid)
    assert event == WorkEvent.FAILED
    assert cause.startswith("agent returned error: \\x1b[2J\\x1b[31mred\\nFAKE LOG LINE\\u202eAAA")
    assert len(cause) < 500 and "more characters)" in cause
    assert cause.isprintable()
