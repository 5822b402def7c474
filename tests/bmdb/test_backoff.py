"""Backoff: the interval vectors, and how failures hide machines."""

from __future__ import annotations

import math
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

import bmdb
from bmdb import Backoff, Process
from bmdb.errors import InvalidArgument
from bmdb.model import Queries
from tests.bmdb.helpers import add_provided_machines, agent_start_source, eventually


def intervals(backoff: Backoff, n: int) -> list[int]:
    out: list[int] = []
    previous = None
    for _ in range(n):
        previous = backoff.next(previous)
        out.append(previous)
    return out


def test_design_vector() -> None:
    backoff = Backoff(initial=60, maximum=120, exponent=1.1)
    assert intervals(backoff, 9) == [60, 66, 73, 81, 90, 99, 109, 120, 120]


def test_exponent_one_or_less_keeps_initial() -> None:
    assert intervals(Backoff(initial=30, maximum=600, exponent=1.0), 3) == [30, 30, 30]
    assert intervals(Backoff(initial=30, maximum=600, exponent=0.5), 3) == [30, 30, 30]


def test_never_below_one_second_and_doubling() -> None:
    assert intervals(Backoff(initial=0, maximum=10, exponent=2), 6) == [1, 2, 4, 8, 10, 10]
    assert Backoff(initial=0.2).next() == 1


def test_no_maximum_means_constant() -> None:
    assert intervals(Backoff(initial=5, exponent=3), 3) == [5, 5, 5]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial": -1},
        {"initial": 10, "maximum": 5},
        {"initial": 1, "exponent": 0},
        {"initial": float("nan")},
    ],
)
def test_invalid_parameters(kwargs: dict[str, float]) -> None:
    with pytest.raises(InvalidArgument):
        Backoff(**kwargs)


async def _stored_interval(conn: bmdb.Connection, machine_id: uuid.UUID) -> int | None:
    async def body(q: bmdb.Queries) -> int | None:
        rows = await q.execute(
            "SELECT last_interval_seconds FROM work_backoff WHERE machine_id = %s", (machine_id,)
        )
        return rows[0][0] if rows else None

    return await conn.transact(body, isolation=bmdb.Isolation.READ_COMMITTED)


async def _candidates(sess: bmdb.Session) -> list[uuid.UUID]:
    async def fn(q: Queries) -> list[uuid.UUID]:
        return [m.machine_id for m in await q.machines_for_agent_start(10)]

    return await sess.transact(fn)


async def test_fail_hides_machine_and_grows_backoff_finish_clears(
    bmdb_conn: bmdb.Connection,
) -> None:
    [machine_id] = await add_provided_machines(bmdb_conn, 1)
    backoff = Backoff(initial=60, maximum=120, exponent=1.1)

    async def this_machine(q: Queries) -> list[uuid.UUID]:
        return [machine_id]

    async with bmdb_conn.session("test") as sess:
        for expected in (60, 66, 73):
            work = await sess.work(Process.SHEPHERD_AGENT_START, this_machine)
            await work.fail("unreachable", backoff)
            assert await _stored_interval(bmdb_conn, machine_id) == expected
            assert await _candidates(sess) == []

        work = await sess.work(Process.SHEPHERD_AGENT_START, this_machine)
        await work.finish()
        assert await _stored_interval(bmdb_conn, machine_id) is None
        assert await _candidates(sess) == [machine_id]


async def test_machine_comes_back_when_backoff_ends(bmdb_conn: bmdb.Connection) -> None:
    [machine_id] = await add_provided_machines(bmdb_conn, 1)
    async with bmdb_conn.session("test") as sess:
        async with await sess.work(Process.SHEPHERD_AGENT_START, agent_start_source) as work:
            await work.fail("flaky", Backoff(initial=1))
        assert await _candidates(sess) == []

        # Real time passes; the machine reappears once `until` is behind us.
        async def reappeared() -> bool:
            return bool(await _candidates(sess))

        await eventually(reappeared)
        assert await _candidates(sess) == [machine_id]


async def test_fail_without_backoff_does_not_hide(bmdb_conn: bmdb.Connection) -> None:
    [machine_id] = await add_provided_machines(bmdb_conn, 1)
    async with bmdb_conn.session("test") as sess:
        work = await sess.work(Process.SHEPHERD_AGENT_START, agent_start_source)
        await work.fail("try again")
        assert await _candidates(sess) == [machine_id]

        async def history(q: Queries) -> list[bmdb.model.HistoryEvent]:
            return await q.history(machine_id)

        events = await sess.transact(history)
    assert [(e.event, e.cause) for e in events] == [
        (bmdb.WorkEvent.STARTED, None),
        (bmdb.WorkEvent.FAILED, "try again"),
    ]


@given(
    initial=st.floats(min_value=0, max_value=3600),
    extra=st.floats(min_value=0, max_value=3600),
    exponent=st.floats(min_value=0.01, max_value=10),
    steps=st.integers(min_value=1, max_value=30),
)
def test_interval_properties(initial: float, extra: float, exponent: float, steps: int) -> None:
    backoff = Backoff(initial=initial, maximum=initial + extra, exponent=exponent)
    seen = intervals(backoff, steps)
    assert seen[0] == max(math.ceil(initial), 1)
    assert all(1 <= s <= max(math.ceil(initial + extra), 1) for s in seen)
    assert seen == sorted(seen)  # never shrinks while failures repeat
    if exponent <= 1:
        assert set(seen) == {seen[0]}
