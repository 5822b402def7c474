"""A three-node cluster, each node its own OS process with real etcd, on 127.0.0.1/2/3.

n1 bootstraps; n2 and n3 register with the owner's ticket, are approved,
and get ConsensusMember; etcd then has three voters and each node runs a
curator, one of them leading. Revoking ConsensusMember from n3 stops its
etcd, removes the member and wipes its data, while n3 stays in the cluster
(its role fetch goes to the remote curators); granting it again joins it
fresh. The owner CLI shows the table.
"""

from __future__ import annotations

import functools
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import trio
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.net import free_loopback_port
from metropolis import identity, pki
from metropolis.consensus.client import Client, Member
from metropolis.consensus.localetcd import etcd_pid
from metropolis.consensus.process import SOCKET_NAME
from metropolis.curator.probe import PROBE_ENV, parse_probe
from metropolis.curator.state import PROBE_KEY
from metropolis.localstorage import Root
from metropolis.owner import NodeRow, Owner, open_owner
from metropolis.proto.management import GetClusterInfoResponse
from metropolis.roleserve import disk
from metropolis.rpc import Endpoint, RPCError, Status, client_context, open_client
from tests.metropolis.test_node_cli import LEADS, NodeProcess, node

BOUND = 100
ADDRESSES = ("127.0.0.1", "127.0.0.2", "127.0.0.3")


def _ports() -> list[str]:
    # One peer, curator and debug port for every node (as in Monogon);
    # each node has its own loopback address.
    return [
        *("--peer-port", str(free_loopback_port())),
        *("--curator-port", str(free_loopback_port())),
        *("--debug-port", str(free_loopback_port())),
    ]


async def _until(check: Callable[[], Awaitable[bool]]) -> None:
    # Polling: the state lives in other processes, nothing here can wake us.
    while not await check():  # noqa: ASYNC110
        await trio.sleep(0.2)


async def _members(root: Root) -> list[Member]:
    async with Client(root.ephemeral.consensus / SOCKET_NAME) as etcd:
        return await etcd.member_list()


async def _rows(owner: Owner) -> dict[str, NodeRow]:
    return {row.address: row for row in await owner.nodes() if row.address}


async def _owner_cli(root: Root, key: Path, *args: str) -> str:
    result = await trio.run_process(
        [
            *(sys.executable, "-m", "metropolis", "owner", "--root", str(root.path)),
            *("--owner-key", str(key), *args),
        ],
        capture_stdout=True,
        capture_stderr=True,
    )
    return result.stdout.decode()


async def _curators(owner: Owner, expected: int) -> bool:
    return sum(r.curator for r in (await _rows(owner)).values()) == expected


async def _voters(root: Root, count: int) -> None:
    async def check() -> bool:
        members = await _members(root)
        return len(members) == count and not any(m.is_learner for m in members)

    await _until(check)


async def approve_registered(owner: Owner) -> tuple[NodeRow, NodeRow, NodeRow]:
    """Approve the two registered nodes; the three rows once all three are UP."""

    async def registered() -> bool:
        rows = await owner.nodes()
        return sum(r.state == "NEW" for r in rows) == 2

    await _until(registered)
    for row in await owner.nodes():
        if row.state == "NEW":
            await owner.approve(row.node_id)

    async def all_up() -> bool:
        rows = await _rows(owner)
        return len(rows) == 3 and all(r.state == "UP" for r in rows.values())

    await _until(all_up)
    rows = await _rows(owner)
    n1, n2, n3 = (rows[a] for a in ADDRESSES)
    return n1, n2, n3


async def _form(owner: Owner, seed: Root) -> tuple[NodeRow, NodeRow, NodeRow]:
    """Approve the two registered nodes and grant each ConsensusMember: three voters."""
    n1, n2, n3 = await approve_registered(owner)
    assert n2.roles == () and n3.roles == ()
    # Nodes without a curator serve their own supervision tree to the owner.
    for row in (n2, n3):

        async def serves_its_tree(row: NodeRow = row) -> bool:
            try:
                tree = await owner.supervision_tree(row)
            except RPCError:  # its debug service may start a moment after its status
                return False
            names = [r.name for r in tree.runnables]
            assert tree.node_id == row.node_id and "root.role.debug" in names
            assert not any(name.endswith(".curator") for name in names)
            return True

        await _until(serves_its_tree)
    for target, count in ((n2, 2), (n3, 3)):
        await owner.set_roles(target.node_id, consensus_member=True)
        await _voters(seed, count)
    return n1, n2, n3


@asynccontextmanager
async def three_nodes(
    tmp_path: Path,
    *,
    probe: bool = False,
    metrics_port: int | None = None,
    health_wait: bool = False,
) -> AsyncIterator[tuple[list[NodeProcess], list[Root], Path]]:
    """n1 bootstraps, n2 and n3 register; ``probe``: every curator runs the leader probe.

    ``metrics_port``: every node serves its metrics on its address and this port.

    Nodes push their status (heartbeat) every second: timeouts after 2 s.
    ``health_wait``: etcd's member health wait (``--member-health-wait``),
    which holds every membership change for 5 s after a voter connects; off
    unless the test is about it.
    """
    roots = [Root(tmp_path / f"n{i}") for i in (1, 2, 3)]
    owner_key = tmp_path / "owner.pem"
    ports = _ports()
    # A 3 s curator lease: the leader-kill test waits one out per kill.
    common = [
        *ports,
        "--raft-tuning",
        "20,200",
        "--insecure-seal",
        "--status-interval",
        "1",
        "--curator-lease-ttl",
        "3",
        "--member-health-wait",
        "on" if health_wait else "off",
    ]
    env = {PROBE_ENV: "1"} if probe else None

    def metrics(address: str) -> list[str]:
        return [] if metrics_port is None else ["--metrics-listen", f"{address}:{metrics_port}"]

    async with AsyncExitStack() as stack:
        n1 = await stack.enter_async_context(
            node(
                "bootstrap",
                "--root",
                str(roots[0].path),
                "--address",
                ADDRESSES[0],
                "--owner-key-out",
                str(owner_key),
                *common,
                *metrics(ADDRESSES[0]),
                env=env,
            )
        )
        await n1.wait_for(LEADS)
        key = pki.decode_private_key(owner_key.read_bytes())
        cluster = tmp_path / "cluster.pb"
        async with open_owner(roots[0], key) as owner:

            async def n1_listed() -> bool:
                info = await owner.info()
                return info.cluster_directory is not None and len(info.cluster_directory.nodes) == 1

            await _until(n1_listed)
            # What 'owner ticket' and 'owner info --out' give (the CLI's own
            # output is checked against these in the three-voters test).
            ticket_hex = (await owner.ticket()).hex()
            cluster.write_bytes(bytes(await owner.info()))
        others = []
        for root, address in zip(roots[1:], ADDRESSES[1:], strict=True):
            others.append(
                await stack.enter_async_context(
                    node(
                        "register",
                        "--root",
                        str(root.path),
                        "--address",
                        address,
                        "--ticket",
                        ticket_hex,
                        "--directory",
                        str(cluster),
                        *common,
                        *metrics(address),
                        env=env,
                    )
                )
            )
        procs = [n1, *others]
        try:
            yield procs, roots, owner_key
        finally:
            for i, proc in enumerate(procs, 1):
                (tmp_path / f"n{i}.log").write_text("\n".join(proc.lines))
            for proc in reversed(procs):
                if proc.process.returncode is None:
                    proc.process.send_signal(signal.SIGTERM)


async def test_three_voters_revoke_and_grant_again(tmp_path: Path) -> None:
    # etcd's member health wait stays on here: without it, a grant right
    # after the revoke was once refused ("member not found") under load.
    with trio.fail_after(BOUND):
        async with three_nodes(tmp_path, health_wait=True) as (procs, roots, owner_key):
            key = pki.decode_private_key(owner_key.read_bytes())
            async with open_owner(roots[0], key) as owner:
                _, _, n3 = await _form(owner, roots[0])
                await _until(lambda: _curators(owner, 3))
                # Exactly one leader: n1 still leads; the others follow it.
                assert procs[0].logged(LEADS)
                assert procs[0].logged("--strict-reconfig-check=true")
                for proc in procs[1:]:
                    await proc.wait_for("following")
                    assert not proc.logged(LEADS)

                # Revoke n3: its member goes, etcd stops and its data is wiped.
                await owner.set_roles(n3.node_id, consensus_member=False)
                await _voters(roots[0], 2)
                await procs[2].wait_for("wiping etcd data")

                async def n3_without_etcd() -> bool:
                    return etcd_pid(roots[2].ephemeral.consensus) is None

                await _until(n3_without_etcd)

                async def n3_wiped() -> bool:
                    # Wiped, then the empty layout made again (not just gone).
                    etcd = roots[2].data.etcd
                    return not (etcd.data / "member").exists() and etcd.peer_pki.path.is_dir()

                await _until(n3_wiped)
                await _until(lambda: _curators(owner, 2))
                n3_row = (await _rows(owner))[ADDRESSES[2]]
                assert "ConsensusMember" not in n3_row.roles and n3_row.state == "UP"

                # Grant again: it joins fresh from wiped data.
                await owner.set_roles(n3.node_id, consensus_member=True)
                await _voters(roots[0], 3)
                await _until(lambda: _curators(owner, 3))
                ticket = (await owner.ticket()).hex()
                ca_certificate = (await owner.info()).ca_certificate

            # The owner CLI, three processes side by side: the table, and the
            # register ticket and cluster file the nodes were started with.
            printed: dict[str, str] = {}
            out = tmp_path / "cluster-cli.pb"

            async def cli(*args: str) -> None:
                printed[args[0]] = await _owner_cli(roots[0], owner_key, *args)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(cli, "nodes")
                nursery.start_soon(cli, "ticket")
                nursery.start_soon(cli, "info", "--out", str(out))
            lines = printed["nodes"].strip().splitlines()
            assert len(lines) == 4 and sum("LEADER" in line for line in lines) == 1
            assert all("ConsensusMember" in line for line in lines[1:])
            assert printed["ticket"] == ticket + "\n"
            info = GetClusterInfoResponse.parse(out.read_bytes())
            assert info.ca_certificate == ca_certificate and info.cluster_directory is not None
            listed = {line.split()[0] for line in printed["info"].splitlines()}
            in_file = {identity.node_id(n.public_key) for n in info.cluster_directory.nodes}
            assert len(listed) == 3 and listed == in_file

        for proc in procs:
            assert proc.process.returncode == 0
        for root in roots:
            assert etcd_pid(root.ephemeral.consensus) is None


def _owner_files(
    root: Root, key_path: Path
) -> tuple[disk.SavedNode, x509.Certificate, Ed25519PrivateKey]:
    certificate = pki.decode_certificate(disk.owner_certificate_path(root).read_bytes())
    return disk.load(root), certificate, pki.decode_private_key(key_path.read_bytes())


@asynccontextmanager
async def _owner_of_all(roots: list[Root], key_path: Path) -> AsyncIterator[Owner]:
    """The owner calling all three curators (the saved directories name only node 1)."""
    saved, certificate, key = _owner_files(roots[0], key_path)
    assert saved.credentials is not None
    endpoints = [Endpoint(a, saved.settings.curator_port) for a in ADDRESSES]
    context = client_context(saved.credentials.ca_certificate, certificate, key)
    # A stopped curator holds connections open without answering: pings
    # every second tell so within two (the default: twenty), and a new
    # connection to it gives up after two seconds (the default: five).
    async with open_client(endpoints, context, connect_timeout=2.0, keepalive=(1.0, 1.0)) as client:
        yield Owner(client, context)


async def _probe_history(root: Root) -> list[tuple[str, int, int]]:
    """Every value the leader probes wrote, in etcd's order: (node id, term, count)."""
    key = b"namespaced/curator/" + PROBE_KEY
    async with Client(root.ephemeral.consensus / SOCKET_NAME) as etcd:
        now = await etcd.range(key)
        history: list[tuple[str, int, int]] = []
        if not now.kvs:
            return history
        last = now.kvs[0].mod_revision
        async with etcd.watch(key, start_revision=1) as watch:
            async for response in watch:
                for event in response.events:
                    assert event.type == "PUT"
                    history.append(parse_probe(event.kv.value))
                if response.events and response.events[-1].kv.mod_revision >= last:
                    return history
    raise AssertionError("the probe key's watch ended")


def _check_one_leader_at_a_time(history: list[tuple[str, int, int]]) -> list[tuple[str, int]]:
    """Assert the probes' writes never interleave; the (node, term) of each run, in order."""
    for i, (node_id, term, count) in enumerate(history, 1):
        assert count == i, f"write {i} by {node_id} (term {term}) counted {count}: lost or repeated"
    runs: list[tuple[str, int]] = []
    for node_id, term, _ in history:
        if not runs or runs[-1] != (node_id, term):
            assert (node_id, term) not in runs, f"term {term} of {node_id} wrote again"
            runs.append((node_id, term))
    terms = [term for _, term in runs]
    assert terms == sorted(terms)
    return runs


async def _health(owner: Owner, node_id: str, health: str) -> bool:
    try:
        rows = {row.node_id: row for row in await owner.nodes()}
    except RPCError as e:
        # The curator the owner talks to may be the stopped or killed one.
        assert e.code is Status.UNAVAILABLE, e
        return False
    return rows[node_id].health == health


async def test_sigstop_and_sigkill_of_the_leader_one_leader_at_a_time(tmp_path: Path) -> None:
    """Failovers under leader-guarded writes, heartbeats, and the killed leader's return.

    Every curator runs the leader probe (:mod:`metropolis.curator.probe`):
    while it believes it leads it counts a key up, guarded only by its term.
    SIGSTOP of the leader makes a stale leader: its lease expires while it
    sleeps, another curator leads, and on SIGCONT it still believes it
    leads, its probe most likely paused between reading and writing. Then
    SIGKILL of the new leader. The key's history must show one (node, term)
    per contiguous run, no lost or repeated count, and writes after both
    failovers. (With the guard removed from ``Leader.txn`` the woken stale
    leader writes over its successor and this fails.)
    """
    with trio.fail_after(300):
        async with (
            three_nodes(tmp_path, probe=True) as (procs, roots, owner_key),
            _owner_of_all(roots, owner_key) as owner,
        ):
            _, n2, _ = await _form(owner, roots[0])
            await _until(lambda: _curators(owner, 3))
            assert procs[0].logged(LEADS)
            ids = [disk.load(root).credentials.node_id for root in roots]  # type: ignore[union-attr]
            for node_id in ids:
                await _until(functools.partial(_health, owner, node_id, "HEALTHY"))

            async def written_by(node_id: str, root: Root) -> bool:
                history = await _probe_history(root)
                return bool(history) and history[-1][0] == node_id

            await _until(lambda: written_by(ids[0], roots[1]))

            # A stale leader: n1 sleeps through the end of its term.
            procs[0].process.send_signal(signal.SIGSTOP)
            try:

                async def someone_leads() -> bool:
                    return any(procs[i].logged(LEADS) for i in (1, 2))

                await _until(someone_leads)
                [second] = [i for i in (1, 2) if procs[i].logged(LEADS)]
                await _until(lambda: written_by(ids[second], roots[second]))
                await _until(functools.partial(_health, owner, ids[0], "HEARTBEAT_TIMEOUT"))
            finally:
                procs[0].process.send_signal(signal.SIGCONT)
            await procs[0].wait_for("following")
            await _until(functools.partial(_health, owner, ids[0], "HEALTHY"))

            # Kill the second leader: n1 or the third node takes over.
            procs[second].process.send_signal(signal.SIGKILL)
            third = 3 - second
            # Writes go on through the new leader (the owner sees one answer).
            for on in (False, True, False, True):

                async def write(on: bool = on) -> bool:
                    try:
                        await owner.set_roles(n2.node_id, kubernetes_controller=on)
                    except RPCError as e:
                        assert e.code is Status.UNAVAILABLE, e
                        return False
                    return True

                await _until(write)

            async def new_term() -> bool:
                history = await _probe_history(roots[third])
                return history[-1][0] != ids[second]

            await _until(new_term)
            # The killed node stops heartbeating; the others are heard.
            await _until(functools.partial(_health, owner, ids[second], "HEARTBEAT_TIMEOUT"))
            for i in (0, third):
                await _until(functools.partial(_health, owner, ids[i], "HEALTHY"))
            table = await _owner_cli(roots[0], owner_key, "nodes")
            assert "HEARTBEAT_TIMEOUT" in table and " ago " in table

            runs = _check_one_leader_at_a_time(await _probe_history(roots[third]))
            writers = [node_id for node_id, _ in runs]
            assert writers[:2] == [ids[0], ids[second]], runs
            assert writers[-1] != ids[second], runs

            # The killed node restarts from disk and rejoins as a voter.
            async with node("run", "--root", str(roots[second].path)) as again:
                await again.wait_for("following")
                await _voters(roots[third], 3)
                again.process.send_signal(signal.SIGTERM)
            assert again.process.returncode == 0
