"""Decommissioning a really installed cluster node, real everything.

The install rig (`tests.fixtures.install_rig`) takes a loopback machine
over and installs the session's node image on it; the node registers into
a cluster bootstrapped on 127.B.1.1 (`tests.loopback`) and the Shepherd's approver admits it;
it is granted a role. Then the operator decommissions the machine with
``python -m bmdb decommission``, and the Shepherd's decommissioner, given
the owner's credentials, revokes the node's role and deletes it from the
cluster before it has the agent wipe the machine: the owner's node table no
longer lists it, its certificate is refused, its node process is stopped,
the disk folder is empty, the machine is a tombstone that no process takes
again. Run under the net lock (fixed loopback addresses and node ports).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio_asyncio

from bmdb import Process, Queries, WorkEvent
from metropolis.localstorage import Root
from metropolis.proto import curator_api as c
from metropolis.proto.common import NodeStatus
from metropolis.roleserve import disk as node_disk
from metropolis.rpc import RPCError, Status, client_context, methods, open_client
from shepherd.approver import run_approver
from shepherd.control_loop import start_control_loop
from shepherd.decommissioner import Decommissioner
from shepherd.localfleet import node_pid
from shepherd.provisioner import sync_provided
from shepherd.rate_limit import Rate, RateLimiter
from shepherd.ssh_key import SSHKey
from tests.fixtures.install_rig import (
    FIRST,
    cli,
    kill_everything_under,
    open_cluster,
    open_rig,
    processes_under,
    until,
)
from tests.shepherd.helpers import agent_keys, events

BOUND = 90.0


async def test_decommissioning_an_installed_node_removes_it_from_the_cluster_then_wipes(
    short_tmp: Path,
    aio_loop: trio_asyncio.TrioEventLoop,  # the fleet's asyncssh servers, the SSH client
    bmdb_url: str,
    node_image: Path,
    shepherd_ssh_key: SSHKey,
) -> None:
    try:
        with trio.fail_after(BOUND):
            async with (
                open_cluster(short_tmp) as cluster,
                open_rig(
                    short_tmp,
                    bmdb_url=bmdb_url,
                    ssh_key=shepherd_ssh_key,
                    image_dir=node_image.parent,
                ) as rig,
            ):
                machine, mid = rig.machines[0], rig.ids[0]
                digest = node_image.name.removesuffix(".pyz")
                await rig.request(rig.image(digest), cluster.node_parameters())
                rig.nursery.start_soon(run_approver, cluster.access, rig.conn, 0.3)

                async def healthy() -> bool:
                    row = await cluster.node_at(machine.host)
                    return row is not None and row.state == "UP" and row.health == "HEALTHY"

                await until(healthy, interval=0.2)
                node = await cluster.node_at(machine.host)
                assert node is not None
                await cli(
                    *cluster.owner_cli, "set-roles", node.node_id, "--kubernetes-controller", "on"
                )
                # The node's own credentials, read before its disk is wiped.
                saved = node_disk.load(Root(rig.disk(0) / "metropolis"))
                credentials = saved.credentials
                assert credentials is not None
                running = node_pid(rig.disk(0))
                assert running is not None

                out = await cli(
                    *("bmdb", "--url", bmdb_url, "decommission", str(mid)),
                    *("--reason", "end of lease"),
                )
                assert "decommission requested" in out
                decommissioner = Decommissioner(
                    rig.provider,
                    rig.ssh,
                    agent_target_path=rig.config.target_path,
                    owner=cluster.access,
                )
                limiter = RateLimiter(Rate(interval=0.01, burst=3))
                start_control_loop(
                    rig.nursery, rig.conn, decommissioner, parallelism=1, limiter=limiter
                )

                async def done() -> bool:
                    history = await events(rig.conn, mid, Process.SHEPHERD_DECOMMISSION)
                    assert all(e != WorkEvent.FAILED for e, _ in history), history
                    return (WorkEvent.FINISHED, "") in history

                await until(done, interval=0.2)

                # The node left the cluster: not listed, its certificate refused.
                assert all(r.node_id != node.node_id for r in await cluster.nodes())
                listed = await cli(*cluster.owner_cli, "nodes")
                assert node.node_id not in listed and FIRST in listed
                context = client_context(
                    credentials.ca_certificate, credentials.certificate, credentials.private_key
                )
                async with open_client(cluster.access.endpoints, context) as as_node:
                    with pytest.raises(RPCError) as refused:
                        await as_node.unary(
                            methods.UPDATE_NODE_STATUS,
                            c.UpdateNodeStatusRequest(
                                node_id=node.node_id,
                                status=NodeStatus(external_address=machine.host),
                            ),
                        )
                assert refused.value.code is Status.UNAUTHENTICATED, refused.value

                # The node and the agent are stopped; the disk folder is empty.
                async def stopped() -> bool:
                    return processes_under(machine.root) == []

                await until(stopped)
                assert rig.disk(0).is_dir() and list(rig.disk(0).iterdir()) == []
                assert not rig.agent(0).with_name("agent.key").exists()

                # The BMDB says what was done, the node's removal first.
                detail = await cli("bmdb", "--url", bmdb_url, "machine", str(mid))
                line = next(x for x in detail.splitlines() if x.startswith("decommission:"))
                assert "decommissioned (a tombstone)" in line
                assert f"node {node.node_id} removed from the cluster" in line
                assert "KubernetesController revoked" in line and "marked removed" in line

                # Never sourced again: no takeover, no re-add by the provider sync.
                history = await rig.conn.transact(lambda q: q.history(mid))
                assert await agent_keys(rig.conn) == {}
                await sync_provided(rig.conn, rig.provider)

                async def machines(q: Queries) -> int:
                    return len(await q.machines())

                assert await rig.conn.transact(machines) == 1
                await trio.sleep(2)  # the initializer runs meanwhile, every 10 ms
                assert await rig.conn.transact(lambda q: q.history(mid)) == history
                assert processes_under(machine.root) == []
    finally:
        # Only if the test failed before the fleet stopped them.
        kill_everything_under(short_tmp)
    assert processes_under(short_tmp) == []
