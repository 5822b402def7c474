"""Operator actions (``python -m bmdb``) against the real initializer, a real
sshd and the real agent: a held machine is not taken over while held, and a
forgotten host key is pinned anew at the next takeover."""

from __future__ import annotations

import base64
import datetime
import functools
import getpass
import json
from collections.abc import Awaitable, Callable
from typing import Any

import trio

import bmdb
from bmdb import Process, Queries, WorkEvent
from metropolis.proto import parameters
from shepherd.agent_bundle import agent_zipapp
from shepherd.control_loop import LoopStats, Processor, run_control_loop, start_control_loop
from shepherd.initializer import Initializer
from shepherd.install import ImageRef, Plan, install
from shepherd.localsshd import Sshd
from shepherd.providers import Machine
from shepherd.providers.static import StaticProvider
from shepherd.rate_limit import Rate, RateLimiter
from shepherd.recoverer import Recoverer
from shepherd.ssh import SSHClient
from shepherd.ssh_key import SSHKey
from tests.bmdb.test_cli import cli
from tests.shepherd.helpers import agent_keys, backoffs, events, host_key_of, provide
from tests.shepherd.test_initializer import agent_config
from tests.shepherd.test_install import SHA, Cluster, _machines, cluster  # noqa: F401 (a fixture)
from tests.shepherd.test_recoverer import KEY, RebootingProvider


async def run_until(
    conn: bmdb.Connection,
    initializer: Processor[Any],
    done: Callable[[LoopStats], Awaitable[bool]],
) -> None:
    """Run a processor's control loop until ``done(stats)``, then cancel it."""
    stats = LoopStats()
    async with trio.open_nursery() as nursery:
        start_control_loop(
            nursery,
            conn,
            initializer,
            parallelism=2,
            limiter=RateLimiter(Rate(0.01, 4)),
            session_interval=10.0,
            stats=stats,
        )
        # A bound for a hung loop, not a performance claim.
        with trio.fail_after(120):
            while not await done(stats):  # noqa: ASYNC110 (the state is in Postgres)
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()


def _initializer(sshd: Sshd, key: SSHKey) -> Initializer:
    provider = StaticProvider([Machine("m-1", sshd.host, sshd.port)])
    ssh = SSHClient(key, username="root", connect_timeout=5.0)
    return Initializer(provider, ssh, agent_config(sshd.root / "agent", agent_zipapp()))


async def test_a_held_machine_is_not_taken_over_until_released(
    aio_loop: object,
    bmdb_conn: bmdb.Connection,
    bmdb_url: str,
    sshd: Sshd,
    shepherd_ssh_key: SSHKey,
) -> None:
    mid = (await provide(bmdb_conn, ["m-1"]))["m-1"]
    code, out, err = await cli(
        "--url", bmdb_url, "hold", str(mid), "--reason", "firmware update", "--operator", "bob"
    )
    assert (code, err) == (0, ""), err
    initializer = _initializer(sshd, shepherd_ssh_key)

    async def idle_a_while(stats: LoopStats) -> bool:
        # The loop keeps looking and finds nothing to do: the machine is held.
        return stats.iterations[initializer.component, "nothing"] >= 20

    await run_until(bmdb_conn, initializer, idle_a_while)
    assert await events(bmdb_conn, mid) == []
    assert await agent_keys(bmdb_conn) == {}
    assert not (sshd.root / "agent").exists()

    code, out, err = await cli("--url", bmdb_url, "release", str(mid), "--reason", "updated")
    assert (code, err) == (0, ""), err

    async def taken_over(stats: LoopStats) -> bool:
        return bool(await agent_keys(bmdb_conn))

    await run_until(bmdb_conn, initializer, taken_over)
    assert await events(bmdb_conn, mid) == [(WorkEvent.STARTED, ""), (WorkEvent.FINISHED, "")]
    assert await host_key_of(bmdb_conn, mid) == sshd.host_key
    code, out, _ = await cli("--url", bmdb_url, "audit", "--json", "--machine", str(mid))
    records = json.loads(out)
    assert [(r["action"], r["operator"], r["reason"]) for r in records] == [
        ("release", getpass.getuser(), "updated"),
        ("hold", "bob", "firmware update"),
    ]


async def test_a_forgotten_host_key_is_pinned_anew_at_the_next_takeover(
    aio_loop: object,
    bmdb_conn: bmdb.Connection,
    bmdb_url: str,
    sshd: Sshd,
    shepherd_ssh_key: SSHKey,
) -> None:
    mid = (await provide(bmdb_conn, ["m-1"]))["m-1"]
    # The key pinned before the machine was reinstalled: not the one its
    # sshd holds now.
    old_key = base64.b64decode(SSHKey.generate().authorized_key.split()[1])

    async def pin(q: Queries) -> None:
        await q.set_ssh_host_key(mid, old_key)

    await bmdb_conn.transact(pin)
    initializer = _initializer(sshd, shepherd_ssh_key)

    async def failed(stats: LoopStats) -> bool:
        return any(e == WorkEvent.FAILED for e, _ in await events(bmdb_conn, mid))

    await run_until(bmdb_conn, initializer, failed)
    [_, (_, cause)] = await events(bmdb_conn, mid)
    assert "SSH host key changed" in cause
    assert mid in await backoffs(bmdb_conn)
    assert await host_key_of(bmdb_conn, mid) == old_key

    for action, reason in (
        ("forget-host-key", "reinstalled the OS, new host key"),
        ("retry-now", "host key forgotten"),
    ):
        code, out, err = await cli("--url", bmdb_url, action, str(mid), "--reason", reason)
        assert (code, err) == (0, ""), err
    assert await host_key_of(bmdb_conn, mid) is None

    async def taken_over(stats: LoopStats) -> bool:
        return bool(await agent_keys(bmdb_conn))

    await run_until(bmdb_conn, initializer, taken_over)
    assert [e for e, _ in await events(bmdb_conn, mid)] == [
        WorkEvent.STARTED, WorkEvent.FAILED, WorkEvent.STARTED, WorkEvent.FINISHED
    ]  # fmt: skip
    # Pinned anew: the key the reinstalled machine's sshd holds.
    assert await host_key_of(bmdb_conn, mid) == sshd.host_key
    code, out, _ = await cli("--url", bmdb_url, "machine", str(mid))
    section = out.split("OPERATOR ACTIONS\n", 1)[1]
    assert "forget-host-key" in section and "retry-now" in section


async def test_recover_now_has_the_recoverer_reboot_a_heartbeating_machine(
    bmdb_conn: bmdb.Connection, bmdb_url: str
) -> None:
    ids = await provide(bmdb_conn, ["wedged", "fine"])
    now = datetime.datetime.now(datetime.UTC)

    async def heartbeating(q: Queries) -> None:
        for mid in ids.values():
            await q.set_agent_started(mid, now, KEY)
            await q.set_agent_heartbeat(mid, now)

    await bmdb_conn.transact(heartbeating)
    code, _, err = await cli(
        "--url", bmdb_url, "recover-now", str(ids["wedged"]), "--reason", "agent wedged"
    )
    assert (code, err) == (0, ""), err
    provider = RebootingProvider([Machine(pid, "ignored") for pid in ids], broken=set())
    recoverer = Recoverer(provider)

    async def recovered() -> bool:
        # Started and finished.
        return len(await events(bmdb_conn, ids["wedged"], Process.SHEPHERD_RECOVERY)) >= 2

    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            functools.partial(
                run_control_loop,
                bmdb_conn,
                recoverer,
                parallelism=1,
                limiter=RateLimiter(Rate(0.01, 4)),
            )
        )
        with trio.fail_after(60):
            while not await recovered():  # noqa: ASYNC110 (the state is in Postgres)
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    # The heartbeating machine the operator named was rebooted and cleared
    # (the initializer takes it over anew); the other one was left alone.
    assert provider.rebooted == ["wedged"]
    assert await events(bmdb_conn, ids["wedged"], Process.SHEPHERD_RECOVERY) == [
        (WorkEvent.STARTED, ""), (WorkEvent.FINISHED, "")
    ]  # fmt: skip
    assert list(await agent_keys(bmdb_conn)) == [ids["fine"]]

    async def requests(q: Queries) -> int:
        return int((await q.execute("SELECT count(*) FROM machine_recovery_request"))[0][0])

    assert await bmdb_conn.transact(requests) == 0


async def test_shepherd_install_refuses_a_held_machine(
    bmdb_conn: bmdb.Connection,
    bmdb_url: str,
    cluster: Cluster,  # noqa: F811 (the fixture imported above)
) -> None:
    held, free = await _machines(bmdb_conn, 2)
    code, _, err = await cli("--url", bmdb_url, "hold", str(held), "--reason", "burn-in")
    assert (code, err) == (0, ""), err
    info = parameters.read_cluster_info(cluster.info)
    params = parameters.register_parameters(info, b"t", cluster.owner_public)
    plan = Plan(parameters.encode(params), ImageRef("https", "h:1", SHA), "disk0")
    decisions = await install(bmdb_conn, plan, machines=[held, free])
    assert [(d.machine_id, d.refused) for d in decisions] == [
        (held, f"held by {getpass.getuser()}: burn-in (python -m bmdb release ends the hold)"),
        (free, None),
    ]
