"""The machine list's counts per state (`console.counts`) over real PostgreSQL:
correct, reused within their period, one query shared by concurrent
requests, a cancelled waiter or a failed query harming no one, and the page
saying when they were taken."""

from __future__ import annotations

import collections
import datetime
import functools
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
import trio
import trio.testing

import bmdb
from bmdb import Provider, overview
from bmdb.errors import BMDBError, InvalidArgument
from bmdb.model import Queries
from bmdb.overview import State, StateCounts
from console.counts import CountsCache
from console.errors import CountsUnavailable
from console.server import serve
from tests.bmdb.helpers import eventually
from tests.operators.populate import Fleet, populate

# Text that only the count statement holds, and only the rows' statement
# (as pg_stat_activity shows them).
COUNT_QUERY = "%count(*) FILTER (WHERE state = 'failed')%"
ROWS_QUERY = "%AS backoff_process%"


@pytest.fixture
async def fleet(bmdb_conn: bmdb.Connection) -> Fleet:
    return await populate(bmdb_conn)


async def _add_machine(conn: bmdb.Connection) -> None:
    async def body(q: Queries) -> None:
        await q.new_machine()

    await conn.transact(body)


async def _count_queries(
    conn: bmdb.Connection, *, waiting: bool, like: str = COUNT_QUERY
) -> list[int]:
    """The server pids running the count statement (or another ``like``)
    now (``waiting``: on a lock)."""

    async def body(q: Queries) -> list[int]:
        rows = await q.execute(
            "SELECT pid FROM pg_stat_activity WHERE query LIKE %s AND pid <> pg_backend_pid()"
            " AND state = 'active' AND (NOT %s OR wait_event_type = 'Lock')",
            (like, waiting),
        )
        return [int(r[0]) for r in rows]

    return await conn.transact(body)


class _Lock:
    """ACCESS EXCLUSIVE on a table the count statement reads, held by a
    transaction of its own until `release`: count queries wait on it."""

    def __init__(self) -> None:
        self._release = trio.Event()

    async def hold(
        self,
        conn: bmdb.Connection,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async def body(q: Queries) -> None:
            await q.execute("LOCK TABLE machine_agent_heartbeat IN ACCESS EXCLUSIVE MODE")
            task_status.started()
            await self._release.wait()

        await conn.transact(body)

    def release(self) -> None:
        self._release.set()


@pytest.fixture
async def lock(
    fleet: Fleet, bmdb_conn: bmdb.Connection, nursery: trio.Nursery
) -> AsyncIterator[_Lock]:
    """`_Lock` held on the populated fleet (pytest-trio sets fixtures up
    concurrently: without ``fleet`` here, populating could wait on the lock)."""
    held = _Lock()
    await nursery.start(held.hold, bmdb_conn)
    try:
        yield held
    finally:
        held.release()


async def _blocked_count_query(conn: bmdb.Connection) -> int:
    """Wait until a count query waits on the lock; its pid."""
    pids: list[int] = []

    async def check() -> bool:
        pids[:] = await _count_queries(conn, waiting=True)
        return bool(pids)

    await eventually(check)
    return pids[0]


async def test_counts_are_those_of_the_listing(fleet: Fleet, bmdb_conn: bmdb.Connection) -> None:
    listed = await overview.machines(bmdb_conn)
    counts = await overview.state_counts(bmdb_conn)
    assert counts.by_state == {s: sum(m.state == s for m in listed) for s in State}
    assert counts.total == len(listed) == 7
    static = await overview.state_counts(bmdb_conn, provider="Static")
    assert static.total == 6 and static.by_state[State.UNPROVIDED] == 0
    assert (await overview.state_counts(bmdb_conn, provider=Provider.EQUINIX)).total == 0
    with pytest.raises(InvalidArgument, match="unknown Provider"):
        await overview.state_counts(bmdb_conn, provider="Nowhere")


async def test_counts_are_reused_within_the_period_and_taken_again_after(
    fleet: Fleet,
    bmdb_conn: bmdb.Connection,
    nursery: trio.Nursery,
    mock_clock: trio.testing.MockClock,
) -> None:
    cache = CountsCache(bmdb_conn, nursery, period=5, max_age=60)
    first = await cache.get()
    assert first.total == 7 and cache.queries == 1
    await _add_machine(bmdb_conn)
    # Within the period: the same counts, no query.
    mock_clock.jump(4)
    assert await cache.get() is first
    assert cache.queries == 1 and cache.in_flight() is None
    # Past the period, within max_age: shown at once while one query runs.
    mock_clock.jump(2)
    assert await cache.get() is first
    flight = cache.in_flight()
    assert flight is not None
    refreshed = await flight.wait()
    assert refreshed.total == 8 and refreshed.by_state[State.UNPROVIDED] == 2
    assert await cache.get() is refreshed
    assert cache.queries == 2
    # Past max_age: waited for.
    await _add_machine(bmdb_conn)
    mock_clock.jump(61)
    latest = await cache.get()
    assert latest.total == 9 and cache.queries == 3
    # Each provider filter has counts of its own.
    static = await cache.get(Provider.STATIC)
    assert static.total == 6 and cache.queries == 4


async def test_concurrent_callers_share_one_query(
    fleet: Fleet, bmdb_conn: bmdb.Connection, nursery: trio.Nursery, lock: _Lock
) -> None:
    cache = CountsCache(bmdb_conn, nursery)
    got: list[StateCounts] = []

    async def one() -> None:
        got.append(await cache.get())

    async with trio.open_nursery() as callers:
        for _ in range(5):
            callers.start_soon(one)
        await _blocked_count_query(bmdb_conn)
        await trio.testing.wait_all_tasks_blocked()
        assert len(await _count_queries(bmdb_conn, waiting=False)) == 1
        lock.release()
    assert len(got) == 5 and all(g is got[0] for g in got)
    assert got[0].total == 7 and cache.queries == 1


async def test_a_cancelled_caller_leaves_the_query_to_the_others(
    fleet: Fleet, bmdb_conn: bmdb.Connection, nursery: trio.Nursery, lock: _Lock
) -> None:
    cache = CountsCache(bmdb_conn, nursery)
    got: list[StateCounts] = []
    gone = trio.CancelScope()

    async def goes_away() -> None:
        with gone:
            await cache.get()
        assert gone.cancelled_caught

    async def waits() -> None:
        got.append(await cache.get())

    async with trio.open_nursery() as callers:
        callers.start_soon(goes_away)  # the caller whose call started the query
        pid = await _blocked_count_query(bmdb_conn)
        callers.start_soon(waits)
        await trio.testing.wait_all_tasks_blocked()
        gone.cancel()
        await trio.testing.wait_all_tasks_blocked()
        # The query it started is still the one the other waits for.
        assert await _count_queries(bmdb_conn, waiting=True) == [pid]
        lock.release()
    assert [g.total for g in got] == [7] and cache.queries == 1


async def test_closing_the_cache_cancels_its_query_and_tells_the_callers(
    fleet: Fleet, bmdb_conn: bmdb.Connection, lock: _Lock
) -> None:
    errors: list[BaseException] = []
    async with trio.open_nursery() as callers, trio.open_nursery() as queries:
        cache = CountsCache(bmdb_conn, queries)

        async def waits() -> None:
            try:
                await cache.get()
            except CountsUnavailable as e:
                errors.append(e)

        callers.start_soon(waits)
        await _blocked_count_query(bmdb_conn)
        queries.cancel_scope.cancel()
    assert len(errors) == 1 and "stopping" in str(errors[0])
    assert await _count_queries(bmdb_conn, waiting=False) == []
    lock.release()


async def _cancel_backend(conn: bmdb.Connection, pid: int) -> None:
    async def body(q: Queries) -> None:
        await q.execute("SELECT pg_cancel_backend(%s)", (pid,))

    await conn.transact(body)


async def test_a_failed_query_is_reported_and_the_next_caller_asks_again(
    fleet: Fleet, bmdb_conn: bmdb.Connection, nursery: trio.Nursery, lock: _Lock
) -> None:
    cache = CountsCache(bmdb_conn, nursery)
    errors: list[BMDBError] = []

    async def waits() -> None:
        try:
            await cache.get()
        except BMDBError as e:
            errors.append(e)

    async with trio.open_nursery() as callers:
        callers.start_soon(waits)
        callers.start_soon(waits)
        await _cancel_backend(bmdb_conn, await _blocked_count_query(bmdb_conn))
    lock.release()
    assert [str(e) for e in errors] == [str(errors[0])] * 2
    assert "canceling statement" in str(errors[0])
    assert cache.in_flight() is None
    counts = await cache.get()
    assert counts.total == 7 and cache.queries == 2


# --- through the web UI -------------------------------------------------------------


def _labels(html: str) -> dict[str, int]:
    """The filter links' counts: {"failed": 2, ...}."""
    return {m[1]: int(m[2]) for m in re.finditer(r">([a-z-]+) \((\d+)\)</a>", html)}


def _as_of(html: str) -> str:
    match = re.search(r'id="counts-age">counts as of <time datetime="([^"]+)"', html)
    assert match, html
    return match[1]


@pytest.fixture
async def web(
    bmdb_conn: bmdb.Connection, nursery: trio.Nursery
) -> Callable[[float], Awaitable[str]]:
    async def start(period: float) -> str:
        urls: list[str] = await nursery.start(
            functools.partial(serve, bmdb_conn, "127.0.0.1:0", counts_period=period)
        )
        return urls[0]

    return start


async def test_the_page_shows_the_counts_and_when_they_were_taken(
    fleet: Fleet, bmdb_conn: bmdb.Connection, web: Callable[[float], Awaitable[str]]
) -> None:
    base = await web(3600)
    async with httpx.AsyncClient(base_url=base) as client:
        first = (await client.get("/machines")).text
        states = collections.Counter(str(m.state) for m in await overview.machines(bmdb_conn))
        labels = _labels(first)
        assert {s: labels[s] for s in states} == dict(states)
        assert labels["all"] == 7 and labels["failed"] == 2
        taken = datetime.datetime.fromisoformat(_as_of(first))
        assert taken.tzinfo is not None
        assert "every 3600 s" in first and "7 shown, 7 in all" in first
        # Within the period: the same counts and time; the rows are read now.
        await _add_machine(bmdb_conn)
        again = (await client.get("/machines")).text
        assert _as_of(again) == _as_of(first) and _labels(again)["all"] == 7
        assert again.count('href="/machine/') == 8
        assert "8 shown, 7 in all" in again


async def test_concurrent_pages_share_one_count_query(
    fleet: Fleet, bmdb_conn: bmdb.Connection, web: Callable[[float], Awaitable[str]], lock: _Lock
) -> None:
    base = await web(5)
    pages: list[str] = []
    async with httpx.AsyncClient(base_url=base) as client:

        async def one() -> None:
            r = await client.get("/machines")
            assert r.status_code == 200
            pages.append(r.text)

        async with trio.open_nursery() as browsers:
            for _ in range(4):
                browsers.start_soon(one)
            await _blocked_count_query(bmdb_conn)

            # Each page asks for its counts before its rows: once the four
            # rows' statements wait, every page has asked.
            async def all_asked() -> bool:
                rows = await _count_queries(bmdb_conn, waiting=True, like=ROWS_QUERY)
                return len(rows) == 4

            await eventually(all_asked)
            assert len(await _count_queries(bmdb_conn, waiting=False)) == 1
            lock.release()
    # One transaction's now(): the pages show one query's counts.
    assert len({_as_of(p) for p in pages}) == 1 and len(pages) == 4
    assert all(_labels(p)["all"] == 7 for p in pages)


async def test_a_failed_count_query_leaves_the_rows_and_the_next_page_asks_again(
    fleet: Fleet, bmdb_conn: bmdb.Connection, web: Callable[[float], Awaitable[str]], lock: _Lock
) -> None:
    base = await web(3600)
    async with httpx.AsyncClient(base_url=base) as client:
        got: list[httpx.Response] = []

        async def load() -> None:
            got.append(await client.get("/machines"))

        async with trio.open_nursery() as browser:
            browser.start_soon(load)
            await _cancel_backend(bmdb_conn, await _blocked_count_query(bmdb_conn))
            lock.release()
        [failed] = got
        assert failed.status_code == 200
        assert "counts unavailable: canceling statement due to user request" in failed.text
        assert failed.text.count('href="/machine/') == 7 and _labels(failed.text) == {}
        assert "7 shown</p>" in failed.text
        # Nothing of the failure was kept: this page takes the counts.
        again = (await client.get("/machines")).text
        assert _labels(again)["all"] == 7 and "counts unavailable" not in again


async def test_console_web_refuses_a_negative_counts_period(bmdb_url: str) -> None:
    argv = [sys.executable, "-m", "console", "--url", bmdb_url, "web", "--counts-period", "-1"]
    result = await trio.run_process(argv, capture_stderr=True, check=False)
    assert result.returncode == 2
    assert "--counts-period must be >= 0, got -1" in result.stderr.decode()


async def test_serve_raises_a_bind_error_as_itself(
    bmdb_conn: bmdb.Connection, web: Callable[[float], Awaitable[str]]
) -> None:
    """The counts' nursery around the server does not hide its errors in a group."""
    taken = (await web(5)).removeprefix("http://")
    with pytest.raises(OSError):
        await serve(bmdb_conn, taken)


def test_the_console_parser_s_counts_period_is_the_counts_default() -> None:
    """``python -m console`` writes the default down (its parser imports no server)."""
    import console.__main__ as cli
    from console.counts import DEFAULT_PERIOD

    assert cli.COUNTS_PERIOD == DEFAULT_PERIOD
