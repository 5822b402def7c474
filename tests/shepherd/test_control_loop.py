"""The control loop runner with a processor that misbehaves on purpose."""

from __future__ import annotations

import random
import uuid
from typing import cast

import pytest
import trio

import bmdb
from bmdb import Backoff, Process, Queries, Work, WorkEvent
from shepherd import control_loop
from shepherd.control_loop import ProcessingFailed, run_control_loop, start_control_loop
from shepherd.rate_limit import Rate, RateLimiter
from tests.shepherd.helpers import backoffs, events
from tests.shepherd.retries import DeadBMDB, assert_backed_off, recorded_waits

PROCESS = Process.UNIT_TEST_1


class Scripted:
    """Does to each machine what ``behaviour`` says."""

    component = "test-loop"
    process = PROCESS
    backoff = Backoff(initial=60)

    def __init__(self, behaviour: dict[uuid.UUID, str]) -> None:
        self.behaviour = behaviour
        self.handled: list[uuid.UUID] = []

    async def source(self, q: Queries) -> uuid.UUID | None:
        ids = await q.machines_for_process(PROCESS, 1)
        return ids[0] if ids else None

    def machine_id(self, task: uuid.UUID) -> uuid.UUID:
        return task

    async def handle(self, work: Work, task: uuid.UUID) -> None:
        self.handled.append(task)
        what = self.behaviour[task]
        if what == "finish":
            await work.finish()
        elif what == "fail":
            raise ProcessingFailed("scripted failure", Backoff(initial=7))
        elif what == "crash":
            raise KeyError("a bug")
        elif what == "leave":
            return  # forgets to close its work


async def test_every_outcome_is_recorded_and_the_loop_goes_on(
    bmdb_conn: bmdb.Connection,
) -> None:
    async def add(q: Queries) -> list[uuid.UUID]:
        return [await q.new_machine() for _ in range(4)]

    ids = await bmdb_conn.transact(add)
    behaviour = dict(zip(ids, ["finish", "fail", "crash", "leave"], strict=True))
    processor = Scripted(behaviour)

    async def all_seen() -> bool:
        for mid in ids:
            if len(await events(bmdb_conn, mid, PROCESS)) < 2:
                return False
        return True

    async with trio.open_nursery() as nursery:
        start_control_loop(
            nursery,
            bmdb_conn,
            processor,
            parallelism=2,
            limiter=RateLimiter(Rate(0.005, 4)),
            session_interval=2.0,
        )
        with trio.fail_after(30):
            while not await all_seen():  # noqa: ASYNC110 (the state is in Postgres)
                await trio.sleep(0.02)
        nursery.cancel_scope.cancel()

    finish, fail, crash, leave = [await events(bmdb_conn, m, PROCESS) for m in ids]
    bug = "internal error: KeyError('a bug')"
    # Finished and left-open machines are sourced again (the generic source
    # has no "done" tag to look at); failed ones are hidden by their backoff.
    assert finish[:2] == [(WorkEvent.STARTED, ""), (WorkEvent.FINISHED, "")]
    assert fail == [(WorkEvent.STARTED, ""), (WorkEvent.FAILED, "scripted failure")]
    assert crash == [(WorkEvent.STARTED, ""), (WorkEvent.FAILED, bug)]
    assert leave[:2] == [(WorkEvent.STARTED, ""), (WorkEvent.CANCELED, "")]
    # The failure's own backoff wins over the processor's default.
    assert await backoffs(bmdb_conn, PROCESS) == {
        ids[1]: (7, "scripted failure"),
        ids[2]: (60, bug),
    }


class Barrier(Scripted):
    """Holds every handled machine until ``width`` are being handled at once."""

    def __init__(self, behaviour: dict[uuid.UUID, str], width: int) -> None:
        super().__init__(behaviour)
        self.width = width
        self.sessions: set[uuid.UUID] = set()
        self.all_in = trio.Event()

    async def handle(self, work: Work, task: uuid.UUID) -> None:
        self.sessions.add(work.session_id)
        self.handled.append(task)
        if len(self.handled) == self.width:
            self.all_in.set()
        await self.all_in.wait()
        raise ProcessingFailed("released")


async def test_workers_run_in_parallel_each_with_its_own_session(
    bmdb_conn: bmdb.Connection,
) -> None:
    async def add(q: Queries) -> list[uuid.UUID]:
        return [await q.new_machine() for _ in range(3)]

    ids = await bmdb_conn.transact(add)
    processor = Barrier(dict.fromkeys(ids, "fail"), width=3)
    async with trio.open_nursery() as nursery:
        start_control_loop(
            nursery, bmdb_conn, processor, parallelism=3, limiter=RateLimiter(Rate(0.005, 4))
        )
        # Fewer than 3 workers would never get 3 machines into handle() at once.
        with trio.fail_after(30):
            await processor.all_in.wait()
        nursery.cancel_scope.cancel()
    assert sorted(processor.handled) == sorted(ids)
    assert len(processor.sessions) == 3


class CountingLimiter(RateLimiter):
    def __init__(self, rate: Rate) -> None:
        super().__init__(rate)
        self.calls = 0

    async def acquire(self) -> float:
        self.calls += 1
        return await super().acquire()


async def test_every_iteration_takes_a_token_from_the_shared_limiter(
    bmdb_conn: bmdb.Connection,
) -> None:
    async def add(q: Queries) -> list[uuid.UUID]:
        return [await q.new_machine() for _ in range(6)]

    ids = await bmdb_conn.transact(add)
    processor = Scripted(dict.fromkeys(ids, "fail"))
    # A bucket of 3 that refills once an hour: 3 iterations, then every worker waits.
    limiter = CountingLimiter(Rate(3600, 3))
    async with trio.open_nursery() as nursery:
        start_control_loop(nursery, bmdb_conn, processor, parallelism=2, limiter=limiter)
        with trio.fail_after(30):
            # Calls 4 and 5 are the two workers, each waiting for a token after
            # its last iteration; a loop that skipped the limiter would instead
            # go through all six machines.
            while limiter.calls < 5 and len(processor.handled) < len(ids):  # noqa: ASYNC110
                await trio.sleep(0.02)
        nursery.cancel_scope.cancel()
    assert limiter.calls == 5
    assert 1 <= len(processor.handled) <= 3
    untouched = [m for m in ids if m not in processor.handled]
    for mid in untouched:
        assert await events(bmdb_conn, mid, PROCESS) == []


async def test_parallelism_must_be_positive(bmdb_conn: bmdb.Connection) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        await run_control_loop(
            bmdb_conn, Scripted({}), parallelism=0, limiter=RateLimiter(Rate(1.0, 1))
        )


async def test_a_lost_session_is_replaced_after_growing_jittered_waits() -> None:
    dead = DeadBMDB()
    stats = control_loop.LoopStats()
    worker = control_loop._Worker(
        cast(bmdb.Connection, dead),
        Scripted({}),
        RateLimiter(Rate(1.0, 1)),
        "test",
        0,
        1.0,
        stats,
        random.Random(7),
    )
    waits = recorded_waits(worker._retrier)
    with trio.move_on_after(0.5):
        await worker.run()
    assert dead.attempts in (len(waits), len(waits) + 1)  # one wait after each loss
    assert stats.iterations["test-loop", "session_lost"] == len(waits)
    assert_backed_off(waits, control_loop.SESSION_BACKOFF)
