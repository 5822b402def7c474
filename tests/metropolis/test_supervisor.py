"""Supervisor behaviour, on trio's MockClock so that timing is exact.

``autojump_clock`` jumps virtual time forward whenever every task is blocked,
so a restart 0.5 s after a failure is observed at exactly +0.5 s.
"""

from __future__ import annotations

import itertools
import logging
import random

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from metropolis.supervisor import BackoffPolicy, Node, State, open_supervisor, supervise

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
    assert sup.state("root.x") is State.STOPPED


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
