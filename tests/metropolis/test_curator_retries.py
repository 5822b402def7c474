"""The curator's retry loops wait through the backoff policy, jittered by an injected random.

Fakes stand in for etcd here (the whole protocols run on real etcd in
:mod:`tests.metropolis.test_curator` and on real nodes in
:mod:`tests.metropolis.test_revoke_leader`). The next leader's half of a
removal: etcd refuses the member's removal twice, as it does while the
cluster settles after a change of leader; the removal is retried after
jittered waits, then completed (the role and the mark go in one write).
The election's watch: opening it fails twice while etcd restarts; it is
opened again after jittered waits and sees the event it waits for.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, cast

import trio

from metropolis.consensus import ConsensusError
from metropolis.consensus import Status as ConsensusStatus
from metropolis.consensus.client import (
    Delete,
    EtcdUnavailable,
    Event,
    KeyValue,
    Op,
    RangeResult,
    WatchResponse,
)
from metropolis.curator import election
from metropolis.curator.records import Records
from metropolis.curator.removal import Removals
from metropolis.curator.state import CONSENSUS_REMOVALS, consensus_removal_key
from metropolis.proto.curator import Node


class _CountingRandom(random.Random):
    def __init__(self) -> None:
        super().__init__(7)
        self.draws = 0

    def uniform(self, a: float, b: float) -> float:
        self.draws += 1
        return super().uniform(a, b)


class _KV:
    """One removal mark, and a watch of the marks that never sees another."""

    def __init__(self) -> None:
        self.watched = trio.Event()

    async def range(self, key: bytes, *, prefix: bool = False) -> RangeResult:
        assert key == CONSENSUS_REMOVALS and prefix
        mark = KeyValue(CONSENSUS_REMOVALS + b"n1", b"n1-key", 5, 5, 1)
        return RangeResult([mark], 1, False, 9)

    @asynccontextmanager
    async def watch(self, key: bytes, **kwargs: Any) -> AsyncIterator[AsyncIterator[object]]:
        self.watched.set()
        await trio.sleep_forever()
        yield cast(AsyncIterator[object], None)  # never reached


class _Records:
    def __init__(self) -> None:
        self.kv = _KV()
        self.updates: list[tuple[str, list[Op]]] = []

    async def update(
        self, node_id: str, change: Callable[[Node], Node | None], also: Sequence[Op] = ()
    ) -> Node:
        self.updates.append((node_id, list(also)))
        return Node()


class _Consensus:
    node_id = "n0"

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.removed: list[bytes] = []

    async def remove_node(self, public_key: bytes) -> None:
        self.removed.append(public_key)
        if len(self.removed) <= self.refusals:
            raise ConsensusError("etcd: leader changed")


async def test_a_refused_removal_is_retried_after_jittered_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    records, consensus, rng = _Records(), _Consensus(refusals=2), _CountingRandom()
    removals = Removals(
        cast(Records, records), cast(ConsensusStatus, consensus), trio.Lock(), rng=rng
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(removals._of_term)
        with trio.fail_after(60):
            await records.kv.watched.wait()
        nursery.cancel_scope.cancel()
    assert consensus.removed == [b"n1-key"] * 3
    assert rng.draws == 2  # one jittered wait after each refusal
    assert records.updates == [("n1", [Delete(consensus_removal_key("n1"))])]


class _RestartingEtcd:
    """Refuses to open a watch ``refusals`` times, then sends one PUT of the key."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.opened = 0

    @asynccontextmanager
    async def watch(
        self, key: bytes, *, start_revision: int = 0
    ) -> AsyncIterator[AsyncIterator[WatchResponse]]:
        self.opened += 1
        if self.opened <= self.refusals:
            raise EtcdUnavailable("etcd restarts")

        async def responses() -> AsyncIterator[WatchResponse]:
            yield WatchResponse([Event("PUT", KeyValue(key, b"", 3, 3, 1))], 3)
            await trio.sleep_forever()

        yield responses()


async def test_the_election_reopens_its_watch_after_jittered_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    kv, rng = _RestartingEtcd(refusals=2), _CountingRandom()
    with trio.fail_after(60):
        await election._until(cast(Any, kv), rng, 2, (b"/consensus-removals/n1", "PUT"))
    assert kv.opened == 3
    assert rng.draws == 2  # one jittered wait after each refusal
