"""Boot assessment: say, once per run, that this node came up healthy in its cluster.

``--announce-healthy FILE``: once the cluster has accepted a status of this
node that carries what it runs (:mod:`.bootinfo`), and, when the node
holds the ConsensusMember role, that names its running curator (its etcd
member and curator serve again), the node writes ``FILE`` atomically::

    {"node_id": "metropolis-...", "image_sha256": "<hex>" | "",
     "slot": "a" | "b" | "none", "trial": true | false}

This is the node's half of an A/B upgrade's health check, like systemd's
``boot-complete.target``: whoever tries a new slot once (``bootprep`` with
the boot check unit on a real disk, the agent on a loopback disk; see
``shepherd/agent/abslots.py``) makes the slot permanent when the file
appears in time, and goes back to the old slot when it does not. The
condition is the cluster's acceptance, not a local self-test: a node that
cannot reach its cluster, or whose control plane does not come back, is
not healthy, whatever else it does.

Written once: the role server runs for the whole boot, and the file lives
in a run-time folder (``/run/metropolis``) that a reboot empties.

Cancellation: cancelled with the role server; the file is written whole
or not at all. Errors: an unwritable file is logged and retried by the
supervisor (OSError from the runnable).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import trio

from common.durable import atomic_write
from metropolis.event import ReadOnlyValue
from metropolis.proto import curator_api as c
from metropolis.proto.common import NodeRoles, NodeStatusRunningImageSlot
from metropolis.supervisor import Node

__all__ = ["HealthAnnounce", "announcement", "healthy"]

_SLOT_NAMES = {NodeStatusRunningImageSlot.A: "a", NodeStatusRunningImageSlot.B: "b"}


def healthy(accepted: c.UpdateNodeStatusRequest, roles: NodeRoles | None) -> bool:
    """Whether an accepted status shows the node healthy for its roles."""
    status = accepted.status
    if status is None or status.image is None:
        return False
    if roles is not None and roles.consensus_member is not None:
        return status.running_curator is not None
    return True


def announcement(accepted: c.UpdateNodeStatusRequest) -> bytes:
    """The file's content for the accepted status ``accepted``."""
    assert accepted.status is not None and accepted.status.image is not None
    image = accepted.status.image
    return (
        json.dumps(
            {
                "node_id": accepted.node_id,
                "image_sha256": image.digest.removeprefix("sha256:"),
                "slot": _SLOT_NAMES.get(image.slot, "none"),
                "trial": image.trial,
            },
            sort_keys=True,
        ).encode()
        + b"\n"
    )


class HealthAnnounce:
    """The boot assessment runnable of one node (see the module docstring).

    ``roles`` is the node's roles value: until it was first set, the node
    counts as holding no role.
    """

    def __init__(
        self,
        path: Path,
        accepted: ReadOnlyValue[c.UpdateNodeStatusRequest],
        roles: ReadOnlyValue[NodeRoles],
    ) -> None:
        self._path = path
        self._accepted = accepted
        self._roles = roles
        #: Set once the file is written.
        self.announced = False

    async def run(self, node: Node) -> None:
        node.signal_healthy()
        if not self.announced:
            accepted = await self._first_healthy()
            await trio.to_thread.run_sync(
                functools.partial(atomic_write, self._path, announcement(accepted), 0o644)
            )
            self.announced = True
            node.logger.info("announced healthy in %s", self._path)
        await trio.sleep_forever()

    async def _first_healthy(self) -> c.UpdateNodeStatusRequest:
        """The first accepted status that is healthy for the roles of its moment."""
        latest: list[c.UpdateNodeStatusRequest | None] = [None]
        roles: list[NodeRoles | None] = [None]
        changed = trio.Event()
        found: list[c.UpdateNodeStatusRequest] = []

        async def follow_accepted() -> None:
            nonlocal changed
            with self._accepted.watch() as watcher:
                while True:
                    latest[0] = await watcher.get()
                    changed.set()

        async def follow_roles() -> None:
            nonlocal changed
            with self._roles.watch() as watcher:
                while True:
                    roles[0] = await watcher.get()
                    changed.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(follow_accepted)
            nursery.start_soon(follow_roles)
            while True:
                await changed.wait()
                changed = trio.Event()
                accepted = latest[0]
                if accepted is not None and healthy(accepted, roles[0]):
                    found.append(accepted)
                    nursery.cancel_scope.cancel()
                    break
        return found[0]
