"""The BMDB on a Patroni cluster: a crash of the primary's postgres is an
ordinary event. Open transactions fail as `DatabaseUnavailable`, the driver
finds the new primary through the multi-host URL, and every commit the old
primary acknowledged is on the new one (synchronous replication)."""

from __future__ import annotations

import html
import logging
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

import httpx
import trio

import bmdb
from bmdb.connection import STANDBY_NOTE
from bmdb.errors import DatabaseUnavailable
from bmdb.localha import LocalPatroni
from bmdb.localserver import LocalPostgresError
from bmdb.model import Queries
from common.backoff import ExponentialBackoff, Retrier
from console.server import serve
from tests.bmdb.helpers import (
    add_provided_machines,
    agent_start_source,
    bulk_provided_machines,
    finish_agent_start,
)

logger = logging.getLogger("tests.bmdb.failover")

T = TypeVar("T")

#: Kills of the primary before Patroni must have failed over at least once.
KILLS = 3
#: Seconds a kill's failover may take before Patroni is taken to have
#: restarted the primary in place (a failover took 2-4 s here).
FAILOVER_WAIT = 20.0

#: How workers wait between attempts while there is no primary.
RETRY = ExponentialBackoff(initial=0.05, maximum=0.5)


async def _new_machine(q: Queries) -> uuid.UUID:
    return await q.new_machine()


async def _server_port(q: Queries) -> int:
    [(port,)] = await q.execute("SELECT inet_server_port()")
    return int(port)


async def _retrying(conn: bmdb.Connection, fn: Callable[[Queries], Awaitable[T]]) -> T:
    """``conn.transact(fn)``, retried while the BMDB is unavailable, as any
    client does while Patroni settles (bounded by the test's timeout)."""
    retrier = Retrier(RETRY)
    with trio.fail_after(120):
        while True:
            try:
                return await conn.transact(fn)
            except DatabaseUnavailable:
                await retrier.sleep()


async def test_no_acknowledged_commit_is_lost_when_the_primary_is_killed(
    ha_bmdb_url: str, patroni_cluster: LocalPatroni
) -> None:
    acknowledged: list[uuid.UUID] = []
    failures: list[BaseException] = []
    killed_at: list[float] = []
    first_after: list[float] = []
    enough = trio.Event()  # set once 200 commits are acknowledged
    failed_over = trio.Event()  # another member leads
    done = trio.Event()  # a commit was acknowledged after that

    async with bmdb.open_connection(ha_bmdb_url) as conn:
        old_port = await conn.transact(_server_port)

        async def committer() -> None:
            retrier = Retrier(RETRY)
            while not done.is_set():
                try:
                    acknowledged.append(await conn.transact(_new_machine))
                except DatabaseUnavailable as e:
                    failures.append(e)
                    await retrier.sleep()
                    continue
                retrier.reset()
                if len(acknowledged) >= 200:
                    enough.set()
                if failed_over.is_set():
                    first_after.append(time.monotonic())
                    done.set()

        async def kill_midway() -> None:
            await enough.wait()
            # Patroni fails over to the synchronous standby when it can; when
            # its look at the standby comes too late (a loaded machine), it
            # restarts the crashed primary in place instead. The commits
            # acknowledged meanwhile must survive too; then it is killed
            # again, since the failover is what this test is about.
            for _ in range(KILLS):
                name = await trio.to_thread.run_sync(patroni_cluster.kill_primary)
                killed_at.append(time.monotonic())
                logger.info("killed the primary's postgres on %s", name)
                try:
                    await trio.to_thread.run_sync(
                        patroni_cluster.wait_new_primary, name, FAILOVER_WAIT
                    )
                except LocalPostgresError:
                    logger.info("no failover from %s; killing the primary again", name)
                    await trio.to_thread.run_sync(patroni_cluster.wait_healthy)
                    continue
                failed_over.set()
                return
            raise AssertionError(f"Patroni restarted the primary in place {KILLS} times")

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(committer)
                nursery.start_soon(kill_midway)

        new_port = await _retrying(conn, _server_port)
        pause = first_after[0] - killed_at[-1]
        print(f"\nprimary lost -> first commit on the new primary: {pause:.2f} s")

        async def stored(q: Queries) -> set[uuid.UUID]:
            rows = await q.execute("SELECT machine_id FROM machines")
            return {r[0] for r in rows}

        on_new_primary = await _retrying(conn, stored)

    assert new_port != old_port
    # The kill cut the committer off: it saw the loss, as the BMDB's own error.
    assert failures
    assert all(isinstance(e, DatabaseUnavailable) for e in failures)
    missing = set(acknowledged) - on_new_primary
    assert not missing, f"{len(missing)} acknowledged commits lost"
    await trio.to_thread.run_sync(patroni_cluster.wait_healthy)


async def test_a_session_and_its_work_outlive_a_failover(
    ha_bmdb_url: str, patroni_cluster: LocalPatroni
) -> None:
    """A session whose interval exceeds the failover pause keeps its row and
    its work across the failover, as across a quick restart of one server:
    its holder finishes the machine on the new primary, and the session
    goes on working."""
    async with bmdb.open_connection(ha_bmdb_url) as conn:
        await bulk_provided_machines(conn, 2)
        async with conn.session("failover-test", "", interval=30.0) as sess:
            work = await sess.work(bmdb.Process.SHEPHERD_AGENT_START, agent_start_source)
            old = await trio.to_thread.run_sync(patroni_cluster.kill_primary)
            await trio.to_thread.run_sync(patroni_cluster.wait_new_primary, old)
            # The pool's connections to the old primary are dead; the
            # transaction notices at BEGIN and runs on a fresh one, which
            # the multi-host URL takes to the new primary.
            async with work:
                await finish_agent_start(work)
            second = await sess.work(bmdb.Process.SHEPHERD_AGENT_START, agent_start_source)
            async with second:
                await finish_agent_start(second)

        async def finished(q: Queries) -> int:
            [(n,)] = await q.execute("SELECT count(*) FROM work_history WHERE event = 'Finished'")
            return int(n)

        assert await conn.transact(finished) == 2
    await trio.to_thread.run_sync(patroni_cluster.wait_healthy)


async def test_the_cli_says_when_it_reads_from_a_standby(
    ha_bmdb_url: str, patroni_cluster: LocalPatroni
) -> None:
    """``bmdb machines`` takes a multi-host URL; with ``prefer-standby``
    (the proxy's replica listener first) it reads from a standby and says
    so, with ``read-write`` it does not."""
    async with bmdb.open_connection(ha_bmdb_url) as conn:
        [machine] = await add_provided_machines(conn, 1)
    dbname = ha_bmdb_url.rsplit("/", 1)[1].split("?")[0]
    standby_url = patroni_cluster.url(dbname, target="prefer-standby")
    outputs = {}
    for url in (standby_url, ha_bmdb_url):
        with trio.fail_after(60):
            while True:
                done = await trio.run_process(
                    [sys.executable, "-m", "bmdb", "--url", url, "machines"],
                    capture_stdout=True,
                    capture_stderr=True,
                    check=False,
                )
                # The standby may not have replayed the machine yet; and the
                # proxy routes the replica listener to the primary until its
                # check of a standby passes (on a loaded machine, moments
                # after the cluster is healthy).
                said = done.stdout.decode()
                standby_seen = url != standby_url or STANDBY_NOTE in said
                if done.returncode == 0 and str(machine) in said and standby_seen:
                    break
                await trio.sleep(0.1)
        outputs[url] = done.stdout.decode()
    assert STANDBY_NOTE in outputs[standby_url]
    assert STANDBY_NOTE not in outputs[ha_bmdb_url]


async def _page(url: str) -> str:
    """/machines as a console on a new connection to ``url`` serves it."""
    async with bmdb.open_connection(url) as conn, trio.open_nursery() as nursery:
        [base] = await nursery.start(serve, conn, "127.0.0.1:0")
        async with httpx.AsyncClient(base_url=base) as client:
            answer = await client.get("/machines")
        nursery.cancel_scope.cancel()
    assert answer.status_code == 200
    return answer.text


async def test_the_web_ui_says_when_it_reads_from_a_standby(
    ha_bmdb_url: str, patroni_cluster: LocalPatroni
) -> None:
    """The console's pages carry the standby note when the console's
    connection reads from a standby, and never on a read-write one.

    With ``prefer-standby`` libpq connects to the primary while no standby
    is ready (one may still be catching up after the failover tests), so
    each try opens a new connection."""
    async with bmdb.open_connection(ha_bmdb_url) as conn:
        [machine] = await add_provided_machines(conn, 1)
    dbname = ha_bmdb_url.rsplit("/", 1)[1].split("?")[0]
    standby_url = patroni_cluster.url(dbname, target="prefer-standby")
    with trio.fail_after(60):
        while True:  # until a standby serves the page and has replayed the machine
            text = await _page(standby_url)
            if str(machine) in text and html.escape(STANDBY_NOTE) in text:
                break
            await trio.sleep(0.2)
    text = await _page(ha_bmdb_url)
    assert str(machine) in text
    assert 'id="standby"' not in text
