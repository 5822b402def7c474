"""Supervisor behaviour, on trio's MockClock so that timing is exact.

``autojump_clock`` jumps virtual time forward whenever every task is blocked,
so a restart 0.5 s after a failure is observed at exactly +0.5 s.
"""

from __future__ import annotations

import itertools
import logging
import random
import time

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from metropolis.supervisor import (
    BackoffPolicy,
    Node,
    RestartRequested,
    RunnableInfo,
    State,
    open_supervisor,
    supervise,
)

EXACT = BackoffPolicy(jitter=0.0)


def gaps_between(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


class Boom(Exception):
    pass


async def sleep_forever(node: Node) -> None:
    node.signal_healthy()
    await trio.sleep_forever()


async def test_runs_root_and_children_under_dotted_names_with_loggers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    loggers: dict[str, str] = {}

    async def child(node: Node) -> None:
        loggers[node.name] = node.logger.name
        node.signal_healthy()
        await trio.sleep_forever()

    async def root(node: Node) -> None:
        loggers[node.name] = node.logger.name
        node.run("consensus", child)
        node.signal_healthy()
        await trio.sleep_forever()

    async with open_supervisor(root, policy=EXACT) as sup:
        await sup.wait_healthy("root.consensus")
        assert sup.state("root") is State.HEALTHY
    assert loggers == {"root": "root", "root.consensus": "root.consensus"}


async def test_failure_restarts_after_initial_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    starts: list[float] = []

    async def flaky(node: Node) -> None:
        starts.append(trio.current_time())
        if len(starts) < 3:
            raise Boom("not yet")
        node.signal_healthy()
        await trio.sleep_forever()

    async with open_supervisor(flaky, policy=EXACT) as sup:
        await sup.wait_healthy("root")
        assert sup.restarts("root") == 2
    # Two consecutive failures: 0.5 s, then 0.5 * 1.5 s.
    assert gaps_between(starts) == pytest.approx([0.5, 0.75])


async def test_backoff_grows_to_cap(autojump_clock: trio.testing.MockClock) -> None:
    starts: list[float] = []

    async def always_fails(node: Node) -> None:
        starts.append(trio.current_time())
        raise Boom

    with trio.move_on_after(600):
        async with open_supervisor(always_fails, policy=EXACT):
            await trio.sleep_forever()
    gaps = gaps_between(starts)
    expected = [min(60.0, 0.5 * 1.5**i) for i in range(len(gaps))]
    assert gaps == pytest.approx(expected)
    assert gaps[-1] == pytest.approx(60.0)


async def test_signal_healthy_resets_backoff(autojump_clock: trio.testing.MockClock) -> None:
    starts: list[float] = []

    async def runnable(node: Node) -> None:
        starts.append(trio.current_time())
        attempt = len(starts)
        if attempt <= 3:
            raise Boom  # three quick failures grow the backoff
        if attempt == 4:
            node.signal_healthy()  # worked for a while...
            await trio.sleep(100)
            raise Boom  # ...then failed: restart quickly again
        node.signal_healthy()
        await trio.sleep_forever()

    async with open_supervisor(runnable, policy=EXACT) as sup:
        while len(starts) < 5:
            await sup.wait_healthy("root")
            await trio.sleep(1)
    gaps = gaps_between(starts)
    assert gaps == pytest.approx([0.5, 0.75, 1.125, 100.5])


async def test_signal_done_is_not_restarted(autojump_clock: trio.testing.MockClock) -> None:
    runs = 0

    async def once(node: Node) -> None:
        nonlocal runs
        runs += 1
        node.signal_done()

    async def root(node: Node) -> None:
        node.run("once", once)
        node.signal_healthy()
        await trio.sleep_forever()

    async with open_supervisor(root, policy=EXACT) as sup:
        await sup.wait_state("root.once", State.DONE)
        await trio.sleep(3600)
        assert sup.state("root.once") is State.DONE
    assert runs == 1


async def test_return_without_done_counts_as_failure(
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs = 0

    async def returns(node: Node) -> None:
        nonlocal runs
        runs += 1

    with trio.move_on_after(1.0):
        async with open_supervisor(returns, policy=EXACT):
            await trio.sleep_forever()
    assert runs == 2  # at 0 and 0.5 s; the next would be at 1.25 s
    assert "returned without signalling done" in caplog.text


async def test_supervise_returns_when_root_is_done(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def root(node: Node) -> None:
        node.signal_done()

    with trio.fail_after(1):
        await supervise(root)


async def test_exception_is_logged_with_traceback_and_spares_siblings(
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ticks = 0

    async def steady(node: Node) -> None:
        nonlocal ticks
        node.signal_healthy()
        while True:
            await trio.sleep(1)
            ticks += 1

    async def crashy(node: Node) -> None:
        await trio.sleep(0.1)
        raise Boom("kaboom")

    async def root(node: Node) -> None:
        node.run("steady", steady)
        node.run("crashy", crashy)
        node.signal_healthy()
        await trio.sleep_forever()

    with caplog.at_level(logging.ERROR):
        async with open_supervisor(root, policy=EXACT) as sup:
            await trio.sleep(10.05)
            assert sup.state("root") is State.HEALTHY
            assert sup.state("root.steady") is State.HEALTHY
            assert sup.restarts("root.steady") == 0
            assert sup.restarts("root.crashy") >= 3
    assert ticks == 10  # never interrupted
    failures = [r for r in caplog.records if r.name == "root.crashy" and r.exc_info]
    assert failures, "failure was not logged with exc_info"
    exc_info = failures[0].exc_info
    assert exc_info is not None and isinstance(exc_info[1], Boom)
    assert exc_info[2] is not None  # a traceback to print


async def test_group_restarts_together(autojump_clock: trio.testing.MockClock) -> None:
    starts = {"a": 0, "b": 0}
    cancelled_b = 0

    async def a(node: Node) -> None:
        starts["a"] += 1
        node.signal_healthy()
        if starts["a"] == 1:
            await trio.sleep(5)
            raise Boom("a dies")
        await trio.sleep_forever()

    async def b(node: Node) -> None:
        nonlocal cancelled_b
        starts["b"] += 1
        node.signal_healthy()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            cancelled_b += 1
            raise

    async def outsider(node: Node) -> None:
        starts.setdefault("outsider", 0)
        starts["outsider"] += 1
        await sleep_forever(node)

    async def root(node: Node) -> None:
        node.run_group({"a": a, "b": b})
        node.run("outsider", outsider)
        node.signal_healthy()
        await trio.sleep_forever()

    async with open_supervisor(root, policy=EXACT) as sup:
        await trio.sleep(6)
        await sup.wait_healthy("root.a")
        await sup.wait_healthy("root.b")
        assert starts == {"a": 2, "b": 2, "outsider": 1}
        assert cancelled_b == 1
        assert sup.restarts("root.b") == 1


async def test_parent_restart_cancels_and_restarts_children_child_failure_spares_parent(
    autojump_clock: trio.testing.MockClock,
) -> None:
    parent_starts = 0
    child_starts = 0
    grandchild_cleanups = 0

    async def grandchild(node: Node) -> None:
        nonlocal grandchild_cleanups
        node.signal_healthy()
        try:
            await trio.sleep_forever()
        finally:
            grandchild_cleanups += 1

    async def child(node: Node) -> None:
        nonlocal child_starts
        child_starts += 1
        node.run("grandchild", grandchild)
        node.signal_healthy()
        if child_starts == 1:
            await trio.sleep(2)
            raise Boom("child dies, parent must not")
        await trio.sleep_forever()

    async def parent(node: Node) -> None:
        nonlocal parent_starts
        parent_starts += 1
        node.run("child", child)
        node.signal_healthy()
        if parent_starts == 1:
            await trio.sleep(10)
            raise Boom("parent dies, children go with it")
        await trio.sleep_forever()

    async def root(node: Node) -> None:
        node.run("parent", parent)
        node.signal_healthy()
        await trio.sleep_forever()

    async with open_supervisor(root, policy=EXACT) as sup:
        await trio.sleep(5)
        # The child failed once and was restarted alone, grandchild with it.
        assert (parent_starts, child_starts, grandchild_cleanups) == (1, 2, 1)
        await trio.sleep(10)
        await sup.wait_healthy("root.parent.child.grandchild")
        # The parent failed: its whole subtree was cancelled and started again.
        assert (parent_starts, child_starts, grandchild_cleanups) == (2, 3, 2)
        assert sup.restarts("root") == 0


async def test_cancelling_the_tree_stops_everything(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cleaned: list[str] = []

    def tracked(label: str) -> object:
        async def runnable(node: Node) -> None:
            node.signal_healthy()
            try:
                await trio.sleep_forever()
            finally:
                cleaned.append(label)

        return runnable

    async def root(node: Node) -> None:
        node.run("x", tracked("x"))  # type: ignore[arg-type]
        node.run("y", tracked("y"))  # type: ignore[arg-type]
        node.signal_healthy()
        await trio.sleep_forever()

    with trio.CancelScope() as scope:
        async with open_supervisor(root, policy=EXACT) as sup:
            await sup.wait_healthy("root.x")
            await sup.wait_healthy("root.y")
            scope.cancel()
    assert sorted(cleaned) == ["x", "y"]
    assert sup.state("root") is State.STOPPED
    # The children ended with the root's attempt: their entries are gone.
    assert [info.name for info in sup.snapshot()] == ["root"]


async def test_instant_failure_loop_does_not_spin(autojump_clock: trio.testing.MockClock) -> None:
    attempts = 0

    async def instant(node: Node) -> None:
        nonlocal attempts
        attempts += 1
        raise Boom

    with trio.move_on_after(10):
        async with open_supervisor(instant, policy=EXACT):
            await trio.sleep_forever()
    # Waits of 0.5, 0.75, 1.125, 1.69, 2.53 (sum 6.6) then 3.8 (sum 10.4):
    # six attempts in ten seconds, not thousands.
    assert attempts == 6


async def test_error_mixed_with_cancelled_still_counts_as_failure(
    autojump_clock: trio.testing.MockClock,
) -> None:
    attempts = 0

    async def nursery_user(node: Node) -> None:
        nonlocal attempts
        attempts += 1

        async def fails() -> None:
            raise Boom("inner")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            nursery.start_soon(fails)

    with trio.move_on_after(1):
        async with open_supervisor(nursery_user, policy=EXACT):
            await trio.sleep_forever()
    assert attempts == 2


async def test_bad_child_names_and_late_run_are_rejected(
    autojump_clock: trio.testing.MockClock,
) -> None:
    errors: list[str] = []
    leaked: list[Node] = []

    async def root(node: Node) -> None:
        node.run("a", sleep_forever)
        for bad in ("a", "", "x.y"):
            try:
                node.run(bad, sleep_forever)
            except ValueError as exc:
                errors.append(str(exc))
        leaked.append(node)
        node.signal_done()

    async with open_supervisor(root, policy=EXACT) as sup:
        await sup.wait_state("root", State.DONE)
    assert len(errors) == 3
    with pytest.raises(RuntimeError, match="after the runnable ended"):
        leaked[0].run("late", sleep_forever)


def test_backoff_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        BackoffPolicy(initial=0)
    with pytest.raises(ValueError):
        BackoffPolicy(multiplier=0.5)
    with pytest.raises(ValueError):
        BackoffPolicy(jitter=1.0)


@given(failures=st.integers(min_value=1, max_value=10_000), seed=st.integers())
def test_backoff_jitter_stays_within_bounds(failures: int, seed: int) -> None:
    policy = BackoffPolicy()
    base = min(60.0, 0.5 * 1.5 ** min(failures - 1, 1000))
    delay = policy.delay(failures, random.Random(seed))
    assert base * 0.75 <= delay <= base * 1.25


# -- exits ---------------------------------------------------------------------


@pytest.mark.parametrize("via", ["run", "scope"])
@pytest.mark.parametrize("exit_type", [SystemExit, KeyboardInterrupt])
async def test_exit_from_a_grandchild_task_ends_supervise(
    autojump_clock: trio.testing.MockClock, exit_type: type[BaseException], via: str
) -> None:
    starts: list[str] = []

    async def grandchild(node: Node) -> None:
        starts.append(node.name)
        node.signal_healthy()

        async def task() -> None:
            await trio.sleep(1)
            raise exit_type(3)

        # On Trio the exit arrives wrapped in (nested) exception groups.
        async with trio.open_nursery() as outer:
            outer.start_soon(trio.sleep_forever)
            async with trio.open_nursery() as inner:
                inner.start_soon(task)
                inner.start_soon(trio.sleep_forever)

    async def child(node: Node) -> None:
        starts.append(node.name)
        if via == "run":
            node.run("grandchild", grandchild)
            await sleep_forever(node)
        async with node.scope() as sub:
            sub.run("grandchild", grandchild)
            await sleep_forever(node)

    async def root(node: Node) -> None:
        starts.append(node.name)
        node.run("child", child)
        await sleep_forever(node)

    # A restart would loop until fail_after, which raises TooSlowError instead.
    with trio.fail_after(3600), pytest.raises(exit_type) as caught:
        await supervise(root, policy=EXACT)
    assert caught.value.args == (3,)
    assert starts == ["root", "root.child", "root.child.grandchild"]


async def test_exit_inside_a_group_ends_open_supervisor(
    autojump_clock: trio.testing.MockClock,
) -> None:
    attempts = 0

    async def root(node: Node) -> None:
        nonlocal attempts
        attempts += 1
        node.signal_healthy()

        async def task() -> None:
            raise KeyboardInterrupt

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            nursery.start_soon(task)

    with trio.fail_after(3600), pytest.raises(KeyboardInterrupt):
        async with open_supervisor(root, policy=EXACT):
            await trio.sleep_forever()
    assert attempts == 1


# -- scopes --------------------------------------------------------------------


class Resource:
    """Something a runnable lends its children; records use after close."""

    def __init__(self) -> None:
        self.closed = False
        self.uses = 0
        self.used_after_close = 0

    def use(self) -> None:
        self.uses += 1
        if self.closed:
            self.used_after_close += 1

    def close(self) -> None:
        self.closed = True


async def test_scope_children_end_before_the_block_is_left(
    autojump_clock: trio.testing.MockClock,
) -> None:
    resource = Resource()
    events: list[str] = []

    async def borrower(node: Node) -> None:
        node.signal_healthy()
        try:
            while True:
                resource.use()
                await trio.sleep(0.1)
        finally:
            # A slow goodbye that still needs the resource.
            with trio.CancelScope(shield=True):
                await trio.sleep(5)
                resource.use()
                events.append("child finished")

    async def root(node: Node) -> None:
        async with node.scope() as sub:
            sub.run("borrower", borrower)
            await trio.sleep(1)
        events.append("block left")
        resource.close()
        node.signal_done()

    async with open_supervisor(root, policy=EXACT) as sup:
        await sup.wait_state("root", State.DONE)
        await trio.sleep(60)  # room for a straggler to misuse the resource
        assert sup.state("root.borrower") is None  # pruned with its scope
    assert events == ["child finished", "block left"]
    assert resource.uses > 10
    assert resource.used_after_close == 0


async def test_scope_children_end_first_when_the_runnable_is_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    resource = Resource()
    events: list[str] = []

    async def borrower(node: Node) -> None:
        node.signal_healthy()
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(5)
                resource.use()
                events.append("child finished")

    async def root(node: Node) -> None:
        node.signal_healthy()
        try:
            async with node.scope() as sub:
                sub.run("borrower", borrower)
                await trio.sleep_forever()
        finally:
            events.append("block left")
            resource.close()

    async with open_supervisor(root, policy=EXACT) as sup:
        await sup.wait_healthy("root.borrower")
    assert events == ["child finished", "block left"]
    assert resource.used_after_close == 0


async def test_nested_scopes_stop_inner_before_outer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stopped: list[str] = []

    def child(label: str, goodbye: float) -> object:
        async def runnable(node: Node) -> None:
            node.signal_healthy()
            try:
                await trio.sleep_forever()
            finally:
                with trio.CancelScope(shield=True):
                    await trio.sleep(goodbye)
                stopped.append(label)

        return runnable

    async def root(node: Node) -> None:
        node.signal_healthy()
        async with node.scope() as outer:
            # The outer child would stop first if both were cancelled together.
            outer.run("outer", child("outer", 0))  # type: ignore[arg-type]
            async with node.scope() as inner:
                inner.run("inner", child("inner", 5))  # type: ignore[arg-type]
                await trio.sleep_forever()

    async with open_supervisor(root, policy=EXACT) as sup:
        await sup.wait_healthy("root.inner")
        await sup.wait_healthy("root.outer")
    assert stopped == ["inner", "outer"]


async def test_scope_child_name_is_reusable_after_the_block(
    autojump_clock: trio.testing.MockClock,
) -> None:
    runs: list[str] = []
    checks: list[str] = []

    async def worker(node: Node) -> None:
        runs.append(node.name)
        await sleep_forever(node)

    async def root(node: Node) -> None:
        async with node.scope() as sub:
            sub.run("worker", worker)
            with pytest.raises(ValueError, match="already runs"):
                node.run("worker", worker)
            with pytest.raises(ValueError, match="already runs"):
                sub.run("worker", worker)
            await trio.sleep(1)
        with pytest.raises(RuntimeError, match="scope that was left"):
            sub.run("late", worker)
        async with node.scope() as again:
            again.run("worker", worker)
            await trio.sleep(1)
        node.run("worker", worker)
        checks.append("ok")
        await sleep_forever(node)

    async with open_supervisor(root, policy=EXACT) as sup:
        await sup.wait_healthy("root")
        await sup.wait_healthy("root.worker")
    assert checks == ["ok"]
    assert runs == ["root.worker"] * 3


async def test_exception_from_a_scope_block_is_not_wrapped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    caught: list[BaseException] = []

    async def root(node: Node) -> None:
        try:
            async with node.scope() as sub:
                sub.run("x", sleep_forever)
                await trio.sleep(1)
                raise Boom("from the block")
        except Boom as exc:
            caught.append(exc)
        node.signal_done()

    async with open_supervisor(root, policy=EXACT) as sup:
        await sup.wait_state("root", State.DONE)
    assert [str(e) for e in caught] == ["from the block"]


# -- restart on request --------------------------------------------------------


async def test_restart_on_request_is_immediate_and_not_a_failure(
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    starts: list[float] = []
    child_cleanups = 0

    async def child(node: Node) -> None:
        nonlocal child_cleanups
        node.signal_healthy()
        try:
            await trio.sleep_forever()
        finally:
            child_cleanups += 1

    async def runnable(node: Node) -> None:
        starts.append(trio.current_time())
        node.run("child", child)
        attempt = len(starts)
        await trio.sleep(1)
        if attempt <= 2:
            node.restart(f"config v{attempt + 1}")
        node.signal_healthy()
        await trio.sleep_forever()

    with caplog.at_level(logging.DEBUG):
        async with open_supervisor(runnable, policy=EXACT) as sup:
            while len(starts) < 3:
                await sup.wait_healthy("root")
            await sup.wait_healthy("root.child")
            info = sup.snapshot()[0]
    # 1 s of work per attempt and nothing else: no backoff at all.
    assert gaps_between(starts) == pytest.approx([1.0, 1.0])
    assert child_cleanups == 3  # two restarts, then the end of the test
    assert info == RunnableInfo("root", State.HEALTHY, 2, None, None)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    requests = [r for r in caplog.records if r.name == "root" and "on request" in r.message]
    assert [r.levelno for r in requests] == [logging.INFO] * 2
    assert "config v2" in requests[0].message
    assert all(r.exc_info is None for r in requests)


async def test_restart_on_request_keeps_the_failure_count(
    autojump_clock: trio.testing.MockClock,
) -> None:
    starts: list[float] = []

    async def runnable(node: Node) -> None:
        starts.append(trio.current_time())
        attempt = len(starts)
        if attempt in (1, 3):
            raise Boom  # never healthy in between: failures 1, then 2
        if attempt == 2:
            # From a task in a nursery: a group of RestartRequested + Cancelled.
            async def ask() -> None:
                node.restart("new config")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.sleep_forever)
                nursery.start_soon(ask)
        node.signal_healthy()
        await trio.sleep_forever()

    async with open_supervisor(runnable, policy=EXACT) as sup:
        while len(starts) < 4:
            await sup.wait_healthy("root")
        assert sup.restarts("root") == 3
    # Had the request counted as a failure: 0.5, 0.75, 1.125.
    assert gaps_between(starts) == pytest.approx([0.5, 0.0, 0.75])


async def test_restart_request_mixed_with_an_error_is_a_failure(
    autojump_clock: trio.testing.MockClock,
) -> None:
    starts: list[float] = []

    async def runnable(node: Node) -> None:
        starts.append(trio.current_time())
        if len(starts) == 1:
            raise ExceptionGroup("both", [RestartRequested("x"), Boom("y")])
        await sleep_forever(node)

    async with open_supervisor(runnable, policy=EXACT) as sup:
        await sup.wait_healthy("root")
    assert gaps_between(starts) == pytest.approx([0.5])


async def test_restart_request_restarts_the_whole_group_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    starts: dict[str, list[float]] = {"a": [], "b": []}

    async def a(node: Node) -> None:
        starts["a"].append(trio.current_time())
        node.signal_healthy()
        if len(starts["a"]) == 1:
            await trio.sleep(1)
            node.restart("a's config changed")
        await trio.sleep_forever()

    async def b(node: Node) -> None:
        starts["b"].append(trio.current_time())
        await sleep_forever(node)

    async def root(node: Node) -> None:
        node.run_group({"a": a, "b": b})
        await sleep_forever(node)

    async with open_supervisor(root, policy=EXACT) as sup:
        await trio.sleep(10)
        assert sup.restarts("root.b") == 1
    # Both restarted when a asked, after its 1 s of work: no backoff passed.
    assert starts == {"a": [0.0, 1.0], "b": [0.0, 1.0]}


# -- snapshot ------------------------------------------------------------------


async def test_snapshot_lists_the_tree_sorted_with_errors(
    autojump_clock: trio.testing.MockClock,
) -> None:
    crashes = 0

    async def crashy(node: Node) -> None:
        nonlocal crashes
        crashes += 1
        if crashes == 1:
            raise Boom("kaboom")
        await sleep_forever(node)

    async def root(node: Node) -> None:
        node.run("zeta", sleep_forever)
        node.run("alpha", crashy)
        await sleep_forever(node)

    before = time.time()
    async with open_supervisor(root, policy=EXACT) as sup:
        await sup.wait_healthy("root.alpha")
        await sup.wait_healthy("root.zeta")
        snapshot = sup.snapshot()
    after = time.time()
    assert [(i.name, i.state, i.restarts) for i in snapshot] == [
        ("root", State.HEALTHY, 0),
        ("root.alpha", State.HEALTHY, 1),
        ("root.zeta", State.HEALTHY, 0),
    ]
    alpha = snapshot[1]
    assert alpha.last_error == "Boom: kaboom"
    assert alpha.last_error_at is not None and before <= alpha.last_error_at <= after
    assert snapshot[2].last_error is None and snapshot[2].last_error_at is None


async def test_snapshot_prunes_children_that_ended(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sizes: list[int] = []
    sup_box: list[object] = []

    async def once(node: Node) -> None:
        node.signal_done()

    async def parent(node: Node) -> None:
        # A fresh batch of children every attempt, all done at once.
        for i in range(3):
            node.run(f"once{i}", once)
        await trio.sleep(1)
        node.restart("again")

    async def root(node: Node) -> None:
        node.run("parent", parent)
        node.signal_healthy()
        for i in range(20):
            async with node.scope() as sub:
                sub.run(f"scoped{i}", sleep_forever)
                await trio.sleep(1)
            sizes.append(len(sup_box[0].snapshot()))  # type: ignore[attr-defined]
        await trio.sleep_forever()

    async with open_supervisor(root, policy=EXACT) as sup:
        sup_box.append(sup)
        await trio.sleep(30)
        names = [i.name for i in sup.snapshot()]
        assert sup.restarts("root.parent") >= 20
    # root, root.parent and at most one batch of root.parent.once*.
    assert max(sizes) <= 5
    assert not [n for n in names if "scoped" in n]
    assert set(names) <= {"root", "root.parent"} | {f"root.parent.once{i}" for i in range(3)}
