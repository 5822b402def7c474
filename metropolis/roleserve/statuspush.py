"""Status push: tell the curators this node's address, debug port, whether its curator runs,
and what it runs (its image and disk slot, :mod:`.bootinfo`).

Monogon's ``worker_statuspush.go``, on Trio: whenever the membership
changes (home at first, then a local curator serving or stopping), send
``UpdateNodeStatus`` with the node's external address and, when it runs a
curator, that curator's port. The leader stores it in the node's record;
granting ConsensusMember needs the address, and the cluster directory is
built from the nodes that run curators.

The same status is sent again every ``status_interval`` seconds: it is the
node's heartbeat, which the leader records for ``GetNodes`` health (a
curator that only heard of a node once could not tell it died). A push
that finds no leader (UNAVAILABLE: an election under way, the leader's
node gone) is retried at the next interval, not raised: the supervisor's
growing backoff would otherwise silence the heartbeat for a minute after a
failover, and the node would look dead. It is logged as role fetch and
directory update log it (:class:`.curatorloss.CuratorOutage`): one WARNING
per outage. The client itself moves on to the next curator of its list.

What the node runs is read again before every push (a try confirmed
healthy turns ``trial`` off without a restart); while this boot is a try,
every `TRIAL_LOOK` seconds, so that its confirmation is pushed at once. Each accepted push is
published in :attr:`StatusPush.accepted` (the request the curator took),
which the boot assessment (:mod:`.bootcheck`) watches.

Cancellation: cancelled with the role server. Errors: :class:`RPCError`
from the curators other than UNAVAILABLE, raised to the supervisor, which
retries after its backoff; a restarted push sends the current status again.
"""

from __future__ import annotations

import trio

from metropolis.event import ReadOnlyValue, Value
from metropolis.proto import curator_api as c
from metropolis.proto.common import NodeStatus, NodeStatusRunningCurator, NodeStatusRunningImage
from metropolis.roleserve.bootinfo import RunningImageSource
from metropolis.roleserve.curatorloss import CuratorOutage
from metropolis.roleserve.disk import NodeSettings
from metropolis.roleserve.rolefetch import curator_endpoints, restart_on_change, wait_home
from metropolis.roleserve.startup import ControlPlaneStartup
from metropolis.roleserve.values import ClusterMembership
from metropolis.rpc import RPCError, client_context, methods, open_client
from metropolis.supervisor import Node

__all__ = ["StatusPush"]


#: Seconds between looks at the boot info while this boot is a try: its
#: confirmation is pushed at once, not at the next interval (the upgrade
#: waits for the cluster to see the slot permanent).
TRIAL_LOOK = 0.25


class StatusPush:
    """The status-push runnable of one node; see the module docstring."""

    def __init__(
        self,
        settings: NodeSettings,
        membership: ReadOnlyValue[ClusterMembership],
        startup: ReadOnlyValue[ControlPlaneStartup] | None = None,
        running: RunningImageSource | None = None,
    ) -> None:
        """``startup``: the control-plane worker's decision (see :func:`.wait_home`);
        ``running``: what the node runs (default: the image of ``METROPOLIS_IMAGE``,
        no boot info)."""
        self._settings = settings
        self._membership = membership
        self._startup = startup
        self._running = running if running is not None else RunningImageSource(None)
        #: The last status update a curator accepted.
        self.accepted: Value[c.UpdateNodeStatusRequest] = Value()
        #: ``trio.current_time()`` of the last push a curator accepted.
        self.last_pushed: float | None = None
        #: Pushes by outcome (``ok``, or the status code of the refusal).
        self.pushes: dict[str, int] = {}

    async def run(self, node: Node) -> None:
        current, credentials = await wait_home(self._membership, self._startup)
        running = (
            NodeStatusRunningCurator(port=self._settings.curator_port)
            if current.local_curator is not None
            else None
        )
        status = NodeStatus(
            external_address=self._settings.address,
            running_curator=running,
            debug_port=self._settings.debug_port,
            image=await self._running.read(),
        )
        context = client_context(
            credentials.ca_certificate, credentials.certificate, credentials.private_key
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(restart_on_change, node, self._membership, current)
            request = c.UpdateNodeStatusRequest(node_id=credentials.node_id, status=status)
            async with open_client(curator_endpoints(self._settings, current), context) as client:
                pushed = False
                outage = CuratorOutage(node.logger, "status push")
                while True:
                    curator = client.endpoint.address
                    try:
                        await client.unary(methods.UPDATE_NODE_STATUS, request)
                    except RPCError as e:
                        self.pushes[e.code.name] = self.pushes.get(e.code.name, 0) + 1
                        outage.lost(e, curator)
                    else:
                        self.accepted.set(request)
                        self.last_pushed = trio.current_time()
                        self.pushes["ok"] = self.pushes.get("ok", 0) + 1
                        outage.recovered(client.endpoint.address)
                        if not pushed:
                            node.logger.info(
                                "status pushed: %s, curator %s",
                                status.external_address,
                                "on" if running else "off",
                            )
                            node.signal_healthy()
                            pushed = True
                    image = await self._next_image(status)
                    if image != status.image:
                        status = NodeStatus(
                            external_address=status.external_address,
                            running_curator=status.running_curator,
                            debug_port=status.debug_port,
                            image=image,
                        )
                        request = c.UpdateNodeStatusRequest(
                            node_id=credentials.node_id, status=status
                        )

    async def _next_image(self, status: NodeStatus) -> NodeStatusRunningImage:
        """What the node runs at the next push: after ``status_interval``, or
        as soon as a try's confirmation shows in the boot info."""
        deadline = trio.current_time() + self._settings.status_interval
        image = status.image
        if image is not None and image.trial:
            while trio.current_time() + TRIAL_LOOK < deadline:
                await trio.sleep(TRIAL_LOOK)
                image = await self._running.read()
                if image != status.image:
                    return image
        await trio.sleep_until(deadline)
        return await self._running.read()
