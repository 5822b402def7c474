"""Event value semantics: first get, newer-only gets, skipping, filters, close, cancellation."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metropolis.event import Closed, Value


async def test_first_get_returns_current_value_then_waits_for_newer() -> None:
    value: Value[int] = Value()
    value.set(1)
    with value.watch() as watcher:
        assert await watcher.get() == 1
        with trio.move_on_after(0.05) as scope:
            await watcher.get()
        assert scope.cancelled_caught, "second get returned without a newer value"
        value.set(2)
        assert await watcher.get() == 2


async def test_first_get_waits_while_unset() -> None:
    value: Value[str] = Value()
    got: list[str] = []

    async def reader() -> None:
        with value.watch() as watcher:
            got.append(await watcher.get())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []
        value.set("ready")
    assert got == ["ready"]


async def test_intermediate_values_are_skipped() -> None:
    value: Value[int] = Value()
    watcher = value.watch()
    value.set(1)
    value.set(2)
    value.set(3)
    assert await watcher.get() == 3


async def test_predicate_skips_values_that_do_not_qualify() -> None:
    value: Value[int] = Value()
    got: list[int] = []

    async def reader() -> None:
        watcher = value.watch()
        got.append(await watcher.get(lambda v: v % 2 == 0))
        got.append(await watcher.get(lambda v: v % 2 == 0))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        for v in (1, 3, 4, 5, 7, 8):
            value.set(v)
            await trio.testing.wait_all_tasks_blocked()
    assert got == [4, 8]


@dataclass
class Membership:
    home: str | None


def is_home(m: Membership | None) -> bool:
    return m is not None and m.home is not None


async def test_filtered_get_as_in_get_home() -> None:
    value: Value[Membership | None] = Value()
    value.set(None)
    value.set(Membership(home=None))
    watcher = value.watch()
    async with trio.open_nursery() as nursery:

        async def later() -> None:
            await trio.testing.wait_all_tasks_blocked()
            value.set(Membership(home="node-1"))

        nursery.start_soon(later)
        got = await watcher.get(is_home)
    assert got == Membership(home="node-1")


async def test_cancelled_get_consumes_nothing() -> None:
    value: Value[int] = Value()
    watcher = value.watch()
    value.set(1)
    assert await watcher.get() == 1
    value.set(2)
    # Cancelled at its first checkpoint, with a new value ready...
    with trio.CancelScope() as scope:
        scope.cancel()
        await watcher.get()
    assert scope.cancelled_caught
    assert await watcher.get() == 2  # ...it took nothing.
    # Cancelled while waiting for a newer value...
    with trio.move_on_after(0.05) as waiting:
        await watcher.get()
    assert waiting.cancelled_caught
    value.set(3)
    assert await watcher.get() == 3  # ...the watcher still moves on normally.


async def test_value_close_delivers_newest_then_raises() -> None:
    value: Value[int] = Value()
    early = value.watch()
    value.set(1)
    assert await early.get() == 1
    late = value.watch()
    value.set(2)
    value.close()
    assert await early.get() == 2
    assert await late.get() == 2
    with pytest.raises(Closed):
        await early.get()
    with pytest.raises(Closed):
        value.set(3)


async def test_value_close_wakes_waiters() -> None:
    value: Value[int] = Value()
    watcher = value.watch()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:

            async def closer() -> None:
                await trio.testing.wait_all_tasks_blocked()
                value.close()

            nursery.start_soon(closer)
            with pytest.raises(Closed):
                await watcher.get()


async def test_watcher_close_wakes_its_waiting_get() -> None:
    value: Value[int] = Value()
    value.set(1)
    watcher = value.watch()
    other = value.watch()
    assert await watcher.get() == 1
    raised = trio.Event()

    async def waiting_get() -> None:
        with pytest.raises(Closed):
            await watcher.get()
        raised.set()

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiting_get)
            await trio.testing.wait_all_tasks_blocked()
            watcher.close()  # no set(): close alone must wake the waiting get
            await raised.wait()
    # Other watchers are unaffected by the spurious wake-up.
    assert await other.get() == 1


async def test_ten_thousand_watchers_woken_by_one_set() -> None:
    value: Value[int] = Value()
    woken = 0

    async def watch() -> None:
        nonlocal woken
        watcher = value.watch()
        assert await watcher.get() == 42
        woken += 1

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for _ in range(10_000):
                nursery.start_soon(watch)
            await trio.testing.wait_all_tasks_blocked()
            assert woken == 0
            value.set(42)
    assert woken == 10_000


# -- property test -----------------------------------------------------------

# A schedule is a list of steps run by the setter task; watchers read
# concurrently, each pausing for its own random numbers of virtual seconds.
steps = st.lists(
    st.one_of(st.just("set"), st.integers(min_value=1, max_value=3)),
    min_size=1,
    max_size=30,
)
pauses = st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=10)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(schedule=steps, watcher_pauses=st.lists(pauses, min_size=1, max_size=6))
async def test_random_interleavings_never_go_back_nor_lose_the_newest(
    autojump_clock: trio.testing.MockClock,
    schedule: list[str | int],
    watcher_pauses: list[list[int]],
) -> None:
    value: Value[int] = Value()
    seen: list[list[int]] = [[] for _ in watcher_pauses]
    done = trio.Event()
    last = 0

    async def setter() -> None:
        nonlocal last
        for step in schedule:
            if step == "set":
                last += 1
                value.set(last)
            else:
                await trio.sleep(int(step))
        done.set()

    async def reader(index: int, pause: list[int]) -> None:
        watcher = value.watch()
        i = 0
        while True:
            with trio.move_on_after(1) as scope:
                # Each get is started with an occasional deliberate
                # cancellation, which must not lose anything.
                got = await watcher.get()
            if scope.cancelled_caught:
                caught_up = last == 0 or (seen[index] and seen[index][-1] == last)
                if done.is_set() and caught_up:
                    return
                continue
            seen[index].append(got)
            await trio.sleep(pause[i % len(pause)])
            i += 1

    async with trio.open_nursery() as nursery:
        for index, pause in enumerate(watcher_pauses):
            nursery.start_soon(reader, index, pause)
        nursery.start_soon(setter)

    for values in seen:
        assert values == sorted(set(values)), f"went back or repeated: {values}"
        assert all(1 <= v <= last for v in values)
        if last:
            assert values and values[-1] == last, f"lost the newest {last}: {values}"


async def test_concurrent_get_on_one_watcher_raises_busy() -> None:
    value: Value[int] = Value()
    watcher = value.watch()
    got: list[int] = []

    async def first() -> None:
        got.append(await watcher.get())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(first)
        await trio.testing.wait_all_tasks_blocked()
        # Without the check this get() would wait (and later steal a value).
        with trio.fail_after(5), pytest.raises(trio.BusyResourceError):
            await watcher.get()
        # The refused get() took nothing: the waiting one still gets the value.
        value.set(1)
    assert got == [1]
    # Free again once the first get() has returned.
    value.set(2)
    assert await watcher.get() == 2


async def test_cancelled_get_frees_the_watcher() -> None:
    value: Value[int] = Value()
    watcher = value.watch()
    with trio.move_on_after(0.01):
        await watcher.get()
    value.set(7)
    assert await watcher.get() == 7


async def test_readonly_view_watches_but_cannot_set() -> None:
    value: Value[str] = Value()
    view = value.readonly()
    assert not hasattr(view, "set")
    assert not hasattr(view, "close")
    with view.watch() as watcher:
        value.set("up")
        assert await watcher.get() == "up"
        value.close()
        with pytest.raises(Closed):
            await watcher.get()


@dataclass(frozen=True)
class _Two:
    a: int
    b: int


async def test_update_changes_its_own_field_of_the_newest_value_and_wakes_watchers() -> None:
    """Two writers, each owning one field, lose nothing of each other's."""
    value: Value[_Two] = Value()
    value.set(_Two(0, 0))
    with value.watch() as watcher:
        assert await watcher.get() == _Two(0, 0)
        value.update(lambda v: _Two(1, v.b))
        value.update(lambda v: _Two(v.a, 2))
        assert await watcher.get() == _Two(1, 2)
        # The same object back sets nothing: the watcher is not woken.
        same = value.update(lambda v: v)
        assert same == _Two(1, 2)
        with trio.move_on_after(0.05) as scope:
            await watcher.get()
        assert scope.cancelled_caught


async def test_update_refuses_a_value_never_set_or_closed() -> None:
    value: Value[int] = Value()
    with pytest.raises(RuntimeError, match="never set"):
        value.update(lambda v: v + 1)
    value.set(1)
    value.close()
    with pytest.raises(Closed):
        value.update(lambda v: v + 1)
