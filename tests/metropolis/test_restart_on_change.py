"""When a node's curator callers restart: on a membership change; for a new local
curator, once it serves."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from metropolis.consensus.membership import Status
from metropolis.curator.service import Curator
from metropolis.event import Value
from metropolis.proto.common import ClusterDirectory
from metropolis.roleserve.rolefetch import restart_on_change
from metropolis.roleserve.values import ClusterMembership
from metropolis.supervisor import Node, RestartRequested


class _Node:
    """What restart_on_change uses of a supervisor node."""

    def restart(self, reason: str) -> None:
        raise RestartRequested(reason)


def _curator() -> Curator:
    return Curator(Value[Status]().readonly(), "metropolis-test")


def _membership(curator: Curator | None = None) -> ClusterMembership:
    return ClusterMembership(b"k", remote_curators=ClusterDirectory(), local_curator=curator)


def _serve(curator: Curator) -> None:
    curator._port.set(7835)  # what the curator does once its API serves


@asynccontextmanager
async def _restarted(
    membership: Value[ClusterMembership], current: ClusterMembership
) -> AsyncIterator[trio.Event]:
    """restart_on_change in the background; the event is set once it restarted."""
    done = trio.Event()

    async def run() -> None:
        node: Node = _Node()  # type: ignore[assignment]
        with pytest.raises(RestartRequested):
            await restart_on_change(node, membership.readonly(), current)
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await trio.testing.wait_all_tasks_blocked()
        yield done
        nursery.cancel_scope.cancel()


async def test_a_new_local_curator_restarts_the_callers_only_once_it_serves() -> None:
    home = _membership()
    membership = Value[ClusterMembership]()
    membership.set(home)
    async with _restarted(membership, home) as done:
        membership.set(_membership())  # same
        await trio.testing.wait_all_tasks_blocked()
        assert not done.is_set()

        curator = _curator()
        membership.set(_membership(curator))
        await trio.testing.wait_all_tasks_blocked()
        assert not done.is_set()  # the remote curators still serve this node

        _serve(curator)
        await trio.testing.wait_all_tasks_blocked()
        assert done.is_set()


async def test_a_local_curator_gone_before_it_served_restarts_nothing() -> None:
    home = _membership()
    membership = Value[ClusterMembership]()
    membership.set(home)
    async with _restarted(membership, home) as done:
        first = _curator()
        membership.set(_membership(first))
        await trio.testing.wait_all_tasks_blocked()
        membership.set(home)  # the control plane stopped before its curator served
        await trio.testing.wait_all_tasks_blocked()
        _serve(first)  # too late: it is not in the membership any more
        await trio.testing.wait_all_tasks_blocked()
        assert not done.is_set()

        second = _curator()
        membership.set(_membership(second))
        await trio.testing.wait_all_tasks_blocked()
        assert not done.is_set()
        _serve(second)
        await trio.testing.wait_all_tasks_blocked()
        assert done.is_set()


async def test_the_local_curator_going_restarts_at_once() -> None:
    curator = _curator()
    _serve(curator)
    local = _membership(curator)
    membership = Value[ClusterMembership]()
    membership.set(local)
    async with _restarted(membership, local) as done:
        membership.set(_membership())
        await trio.testing.wait_all_tasks_blocked()
        assert done.is_set()
