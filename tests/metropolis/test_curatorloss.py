"""Losing the curator a role fetch or directory update streams from: a WARNING
and a reconnect, no ERROR.

A real curator (real etcd under it) is stopped and started again on the
same port while a :class:`RoleFetch` and a :class:`DirectoryUpdate` watch
through it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from common.net import free_loopback_port
from metropolis import identity
from metropolis.consensus import Status as ConsensusStatus
from metropolis.curator.election import Leader
from metropolis.curator.service import Curator
from metropolis.event import ReadOnlyValue, Value
from metropolis.localstorage import Root
from metropolis.proto.common import (
    ClusterDirectory,
    ClusterDirectoryNode,
    ClusterDirectoryNodeAddress,
    NodeRoles,
)
from metropolis.roleserve.directory import DirectoryUpdate
from metropolis.roleserve.disk import NodeSettings, read_roles
from metropolis.roleserve.rolefetch import RoleFetch
from metropolis.roleserve.values import ClusterMembership
from metropolis.supervisor import open_supervisor
from tests.metropolis.test_consensus import eventually
from tests.metropolis.test_curator import bootstrapped, consensus

BOUND = 60


@asynccontextmanager
async def serving(
    status: ReadOnlyValue[ConsensusStatus], credentials: identity.NodeCredentials, port: int
) -> AsyncIterator[None]:
    """A curator on ``port`` that leads, for the duration of the block."""
    curator = Curator(
        status, credentials.node_id, credentials=credentials, listen=("127.0.0.1", port)
    )
    async with open_supervisor(curator.run, name="curator"):
        with trio.fail_after(BOUND):
            with curator.port.watch() as w:
                await w.get()
            with curator.election.watch() as e:
                await e.get(lambda s: isinstance(s, Leader))
        yield


async def start_curator(
    nursery: trio.Nursery,
    status: ReadOnlyValue[ConsensusStatus],
    credentials: identity.NodeCredentials,
    port: int,
) -> Callable[[], Awaitable[None]]:
    """Start a curator in ``nursery``; return the function that stops it for good."""
    scope = trio.CancelScope()
    stopped = trio.Event()

    async def run(*, task_status: trio.TaskStatus[None]) -> None:
        try:
            with scope:
                async with serving(status, credentials, port):
                    task_status.started()
                    await trio.sleep_forever()
        finally:
            stopped.set()

    async def stop() -> None:
        scope.cancel()
        await stopped.wait()

    await nursery.start(run)
    return stop


def _messages(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if text in r.getMessage()]


async def test_a_role_fetch_reconnects_when_its_curator_stops_and_returns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with consensus(tmp_path) as (service, _, status):
        _, credentials = await bootstrapped(service, status)
        port = free_loopback_port()
        membership: Value[ClusterMembership] = Value()
        membership.set(
            ClusterMembership(
                public_key=credentials.public_key,
                credentials=credentials,
                remote_curators=ClusterDirectory(
                    nodes=[
                        ClusterDirectoryNode(
                            public_key=credentials.public_key,
                            addresses=[ClusterDirectoryNodeAddress(host="127.0.0.1")],
                        )
                    ]
                ),
            )
        )
        roles: Value[NodeRoles] = Value()
        settings = NodeSettings(address="127.0.0.1", curator_port=port)
        root = Root(tmp_path / "node")
        root.create()
        fetch = RoleFetch(root, settings, membership.readonly(), roles)
        directory = DirectoryUpdate(root, settings, membership)
        async with trio.open_nursery() as nursery:
            first = await start_curator(nursery, service.status, credentials, port)
            async with (
                open_supervisor(fetch.run, name="rolefetch") as fetching,
                open_supervisor(directory.run, name="directory") as updating,
            ):
                with trio.fail_after(BOUND), roles.watch() as watcher:
                    got = await watcher.get()
                    # Published only once durable: the worker acts on them.
                    assert read_roles(root) == got
                    await updating.wait_healthy("directory")
                assert got.consensus_member is not None

                # The curator goes: one WARNING each, and they keep trying.
                await first()
                with trio.fail_after(BOUND):
                    await eventually(lambda: len(_messages(caplog, "lost curator")) == 2)
                # It is back: both stream from it again by themselves.
                second = await start_curator(nursery, service.status, credentials, port)
                with trio.fail_after(BOUND):
                    await eventually(lambda: len(_messages(caplog, "answers again")) == 2)
                assert fetching.restarts("rolefetch") == 0
                assert updating.restarts("directory") == 0
            await second()
    lost = _messages(caplog, "lost curator")
    assert sorted(r.getMessage().split(":")[0] for r in lost) == ["directory update", "role fetch"]
    for record in lost:
        assert record.levelno == logging.WARNING
        assert f"127.0.0.1:{port}" in record.getMessage()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
