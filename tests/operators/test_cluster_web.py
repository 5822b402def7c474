"""The web UI's cluster pages against a real node (an OS process with its etcd),
in a real browser; the node's debug service refuses all but the owner. A
BMDB machine whose install report carries the node's key links to the
node's page, and the node's pages link back to it.
"""

from __future__ import annotations

import functools
import html
import signal
import sys
from pathlib import Path

import httpx
import pytest
import trio
from playwright.async_api import BrowserContext, Page

import bmdb
from console.cluster import ClusterView
from console.server import serve
from metropolis import identity, pki
from metropolis.localstorage import Root
from metropolis.owner import load_owner, load_owner_key
from metropolis.proto import management as m
from metropolis.roleserve import disk
from metropolis.rpc import Endpoint, RPCError, Status, client_context, methods, open_client
from tests.metropolis.test_node_cli import LEADS, NodeProcess, bootstrap_args, node
from tests.operators.browser import Chromium
from tests.operators.populate import populate_installs

#: Generous: a node's bootstrap and the browser share two cores with
#: other tests (one run under a load of 10 took over 120 s).
BOUND = 240
CONSENSUS = "root.role.controlplane.launcher.consensus"
CURATOR = "root.role.controlplane.launcher.curator"


async def _running_node(proc: NodeProcess) -> None:
    await proc.wait_for(LEADS)
    # The status that names the debug port reached the curator.
    await proc.wait_for("status pushed")
    await proc.wait_for("debug service on")


async def _cells(page: Page) -> list[list[str]]:
    rows: list[list[str]] = await page.eval_on_selector_all(
        "main table tbody tr", "rows => rows.map(r => Array.from(r.cells, c => c.innerText))"
    )
    return rows


async def test_nodes_leader_and_supervision_tree_in_a_browser_then_curator_gone(
    tmp_path: Path, bmdb_conn: bmdb.Connection, chromium: Chromium
) -> None:
    root = Root(tmp_path / "n")
    with trio.fail_after(BOUND):
        async with node(*bootstrap_args(tmp_path)) as proc, trio.open_nursery() as nursery:
            await _running_node(proc)
            credentials = identity.NodeCredentials.load(root.data.node_credentials)
            node_id = credentials.node_id
            # As if this node had been installed on a machine of the fleet:
            # that machine's agent reported the node's key.
            installs = await populate_installs(bmdb_conn, credentials.public_key)
            machine = str(installs.installed)
            view = ClusterView(load_owner(root, load_owner_key(tmp_path / "owner.pem")))
            urls = await nursery.start(
                functools.partial(serve, bmdb_conn, "127.0.0.1:0", cluster=view)
            )
            web: str = urls[0]

            async def scenario(context: BrowserContext) -> list[list[str]]:
                page = await context.new_page()
                await page.goto(f"{web}/machines")
                await page.get_by_role("link", name="Cluster", exact=True).click()
                await page.wait_for_url("**/cluster")
                rows = await _cells(page)
                assert [r[0] for r in rows] == [node_id]
                _, listed_machine, address, state, roles, curator, *_ = rows[0]
                assert (address, state, curator) == ("127.0.0.1", "UP", "leader")
                assert "ConsensusMember" in roles and "KubernetesController" in roles
                assert listed_machine == machine
                await page.get_by_role("link", name=node_id).click()
                await page.wait_for_url(f"**/cluster/node/{node_id}")
                node_fields = await page.inner_text("table.fields")
                assert "curator\tleader" in node_fields
                assert f"machine\t{machine}" in node_fields
                # Node -> machine -> node: both pages link to each other.
                await page.get_by_role("link", name=machine).click()
                await page.wait_for_url(f"**/machine/{machine}")
                install = await page.inner_text("h2:has-text('OS installation') + table")
                assert f"node\t{node_id}" in install
                await page.get_by_role("link", name=node_id).click()
                await page.wait_for_url(f"**/cluster/node/{node_id}")
                assert "curator\tleader" in await page.inner_text("table.fields")
                await page.get_by_role("link", name="supervision tree").click()
                await page.wait_for_url(f"**/cluster/node/{node_id}/tree")
                # The tree is live: wait (reloading) until both are healthy.
                # Bounded here too, so that the page says why it gave up.
                for _ in range(BOUND * 2):
                    tree = {r[0]: r for r in await _cells(page)}
                    if all(tree.get(n, ["", ""])[1] == "HEALTHY" for n in (CONSENSUS, CURATOR)):
                        break
                    await page.wait_for_timeout(500)
                    await page.reload()
                else:
                    raise AssertionError(f"consensus and curator never healthy: {tree}")
                assert "root.role.debug" in tree
                assert "<" not in await page.inner_text("body")
                return list(tree.values())

            tree = await chromium.run(scenario)
            assert all(len(r) == 5 for r in tree)

            # The curator goes: the page explains, as a page with the navigation.
            proc.process.send_signal(signal.SIGTERM)
            with trio.fail_after(BOUND):
                await proc.process.wait()
            curator = f"127.0.0.1:{disk.load(root).settings.curator_port}"
            async with httpx.AsyncClient(base_url=web) as client:
                for path in ("/cluster", f"/cluster/node/{node_id}/tree"):
                    r = await client.get(path)
                    assert r.status_code == 200
                    # An apostrophe is escaped (&#39; from the templates): read as text.
                    assert "Cannot reach the cluster's curators" in html.unescape(r.text)
                    assert f"<code>{curator}</code>" in r.text
                    assert "Error: " in r.text and "Traceback" not in r.text
                    assert '<a href="/machines">Machines</a>' in r.text
            nursery.cancel_scope.cancel()


async def test_debug_service_answers_only_the_owner(tmp_path: Path) -> None:
    root = Root(tmp_path / "n")
    with trio.fail_after(BOUND):
        async with node(*bootstrap_args(tmp_path)) as proc:
            await _running_node(proc)
            saved = disk.load(root)
            credentials = saved.credentials
            assert credentials is not None
            endpoint = Endpoint("127.0.0.1", saved.settings.debug_port, credentials.public_key)
            request = m.GetSupervisionTreeRequest()

            # The owner is answered, by this node.
            owner_key = load_owner_key(tmp_path / "owner.pem")
            owner_certificate = pki.decode_certificate(
                disk.owner_certificate_path(root).read_bytes()
            )
            owner = client_context(credentials.ca_certificate, owner_certificate, owner_key)
            async with open_client([endpoint], owner) as client:
                tree = await client.unary(methods.GET_SUPERVISION_TREE, request)
            assert tree.node_id == credentials.node_id
            assert "root.role.debug" in [r.name for r in tree.runnables]
            # The same through the owner's CLI.
            result = await trio.run_process(
                [
                    *(sys.executable, "-m", "metropolis", "owner", "--root", str(root.path)),
                    *("--owner-key", str(tmp_path / "owner.pem"), "tree", credentials.node_id[:20]),
                ],
                capture_stdout=True,
            )
            lines = result.stdout.decode().splitlines()
            assert lines[0].split() == ["RUNNABLE", "STATE", "RESTARTS", "LAST", "ERROR"]
            assert {"root.role.debug", CURATOR} <= {line.split()[0] for line in lines[1:]}

            # A node certificate of the same cluster is not the owner's.
            as_node = client_context(
                credentials.ca_certificate, credentials.certificate, credentials.private_key
            )
            async with open_client([endpoint], as_node) as client:
                with pytest.raises(RPCError) as refused:
                    await client.unary(methods.GET_SUPERVISION_TREE, request)
            assert refused.value.code == Status.PERMISSION_DENIED

            # An "owner" certificate of another CA fails the handshake.
            other_ca_key = pki.generate_key()
            other_ca = pki.new_ca(other_ca_key, "other CA")
            forged = pki.issue_certificate(
                other_ca_key,
                other_ca,
                owner_key.public_key(),
                identity.OWNER_COMMON_NAME,
                pki.Usage.CLIENT,
            )
            foreign = client_context(credentials.ca_certificate, forged, owner_key)
            async with open_client([endpoint], foreign) as client:
                with pytest.raises(RPCError) as refused:
                    await client.unary(methods.GET_SUPERVISION_TREE, request)
            assert refused.value.code == Status.UNAUTHENTICATED
            proc.process.send_signal(signal.SIGTERM)
