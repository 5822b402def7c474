"""The owner acting on a cluster: what the CLI says, owner access without a node's disk,
deleting a dead node.

Three real nodes (each its own OS process, real etcd) on 127.0.0.1/2/3, as
in :mod:`tests.metropolis.test_cluster`, all three voters with curators.
The owner then works only with its key and the file ``owner info --out``
wrote: the bootstrap node n1 (the leading curator) is killed and its disk
removed; during the failover the node table still answers (from a
follower, marked stale), and through the others' curators (an escrowed
owner certificate) n1 is deleted once its heartbeat timed out. Its etcd
member goes, and its certificate is refused by every curator from then on.
"""

from __future__ import annotations

import shutil
import signal
import sys
from pathlib import Path

import trio

from metropolis import pki
from metropolis.owner import Owner, load_owner_from_cluster
from metropolis.proto import curator_api as c
from metropolis.proto.common import NodeStatus
from metropolis.roleserve import disk
from metropolis.rpc import Endpoint, RPCError, Status, client_context, methods, open_client
from tests.metropolis.test_cluster import (
    ADDRESSES,
    BOUND,
    _curators,
    _form,
    _members,
    _owner_of_all,
    _until,
    three_nodes,
)


async def _cli(*args: str | Path) -> tuple[int, str, str]:
    """``python -m metropolis owner ARGS``: exit status, stdout, stderr."""
    result = await trio.run_process(
        [sys.executable, "-m", "metropolis", "owner", *(str(a) for a in args)],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    return result.returncode, result.stdout.decode(), result.stderr.decode()


def _table(out: str) -> dict[str, list[str]]:
    """The node table's rows by node ID: each row's columns (last heartbeat as one)."""
    rows = {}
    for line in out.splitlines()[1:]:
        if line.startswith("metropolis-"):
            columns = line.replace(" ago", "_ago").split()
            rows[columns[0]] = columns
    return rows


async def _healthy(owner: Owner, count: int) -> bool:
    rows = await owner.nodes()
    return sum(r.health == "HEALTHY" for r in rows) == count


async def test_owner_with_only_the_key_deletes_the_dead_bootstrap_node(tmp_path: Path) -> None:
    with trio.fail_after(2 * BOUND):
        async with (
            three_nodes(tmp_path) as (procs, roots, owner_key),
            _owner_of_all(roots, owner_key) as owner,
        ):
            n1, n2, n3 = await _form(owner, roots[0])
            await _until(lambda: _curators(owner, 3))
            await _until(lambda: _healthy(owner, 3))
            port = str(disk.load(roots[0]).settings.curator_port)
            info = tmp_path / "cluster-now.pb"
            code, out, err = await _cli(
                *("--root", roots[0].path, "--owner-key", owner_key, "info", "--out", info)
            )
            assert code == 0 and len(out.splitlines()) == 3, (out, err)
            by_file = ("--cluster", info, "--curator-port", port, "--owner-key", owner_key)

            # The table: sorted by address, each member a voter, one leader.
            code, out, err = await _cli(*by_file, "nodes")
            assert code == 0, err
            assert "ETCD" in out.splitlines()[0]
            rows = _table(out)
            assert list(rows) == [n1.node_id, n2.node_id, n3.node_id], out
            assert [r[1] for r in rows.values()] == list(ADDRESSES)
            assert all(r[6] == "voter" for r in rows.values()), out
            assert rows[n1.node_id][5] == "LEADER", out
            assert [r[5] for r in rows.values()].count("LEADER") == 1, out

            # Any node's root works, not only the bootstrap node's (which
            # alone keeps an owner certificate): n2's escrows one.
            assert not disk.owner_certificate_path(roots[1]).exists()
            code, out, err = await _cli("--root", roots[1].path, "--owner-key", owner_key, "nodes")
            assert code == 0 and len(_table(out)) == 3, err

            # set-roles says what changed, and that nothing did.
            code, out, err = await _cli(
                *by_file, "set-roles", n2.node_id, "--kubernetes-controller", "on"
            )
            assert code == 0, err
            assert out.strip() == (
                f"{n2.node_id}: KubernetesController granted "
                "(roles now ConsensusMember,KubernetesController)"
            ), out
            code, out, err = await _cli(
                *by_file, "set-roles", n2.node_id, "--kubernetes-controller", "off"
            )
            assert code == 0 and "KubernetesController revoked" in out, (out, err)

            # A live node with roles is not deleted, even forced (more
            # refusals: tests/metropolis/test_owner_api.py).
            code, out, err = await _cli(*by_file, "delete", n3.node_id, "--force")
            assert code == 2 and "has not timed out" in err, (out, err)

            # n1, the leading curator, dies and its disk is gone.
            saved = disk.load(roots[0])
            assert saved.credentials is not None
            credentials = saved.credentials
            peer = pki.decode_certificate(roots[0].data.etcd.peer_pki.certificate.read_bytes())
            procs[0].process.send_signal(signal.SIGKILL)
            await procs[0].process.wait()
            shutil.rmtree(roots[0].path)

            # Within the dead leader's lease nobody leads: a follower answers.
            rows_now = await owner.nodes()
            assert len(rows_now) == 3 and all(r.stale for r in rows_now), rows_now
            assert not any(r.leader for r in rows_now)

            # Only the key and the file, from here on.
            code, out, err = await _cli(*by_file, "nodes")
            assert code == 0 and len(_table(out)) == 3, (out, err)

            async def n1_timed_out() -> bool:
                rows = {r.node_id: r for r in await owner.nodes()}
                led = any(r.leader for r in rows.values())
                return led and rows[n1.node_id].health == "HEARTBEAT_TIMEOUT"

            await _until(n1_timed_out)
            code, out, err = await _cli(*by_file, "nodes")
            assert code == 0, err
            rows = _table(out)
            assert rows[n1.node_id][5] == "down", out
            assert [r[5] for r in rows.values()].count("LEADER") == 1, out
            assert "may be stale" not in out, out

            code, out, err = await _cli(*by_file, "delete", n1.node_id, "--force")
            assert code == 0, err
            assert out.startswith(f"deleted {n1.node_id} (address {ADDRESSES[0]})"), out
            assert "its etcd member (voter) removed" in out, out
            assert "certificate revoked" in out, out

            code, out, err = await _cli(*by_file, "nodes")
            assert code == 0 and list(_table(out)) == [n2.node_id, n3.node_id], (out, err)
            assert all(m.name != n1.node_id for m in await _members(roots[1]))
            assert len(await _members(roots[1])) == 2

            # Its etcd peer certificate is revoked too (etcd's peer CRL on disk).
            async def peer_revoked() -> bool:
                crl = pki.decode_crl(roots[1].data.etcd.peer_crl.read_bytes())
                return pki.is_revoked(crl, peer)

            await _until(peer_revoked)

            # n1's certificate: refused by each curator left, leader or not.
            context = client_context(
                credentials.ca_certificate, credentials.certificate, credentials.private_key
            )
            for address in ADDRESSES[1:]:
                async with open_client([Endpoint(address, int(port))], context) as client:
                    try:
                        await client.unary(
                            methods.UPDATE_NODE_STATUS,
                            c.UpdateNodeStatusRequest(
                                node_id=n1.node_id,
                                status=NodeStatus(external_address=ADDRESSES[0]),
                            ),
                        )
                    except RPCError as e:
                        assert e.code is Status.UNAUTHENTICATED, e
                        assert "revoked" in e.message, e
                    else:
                        raise AssertionError(f"{address} took a deleted node's call")

            # The owner's API, as the CLI uses it, escrows from the file too.
            access = load_owner_from_cluster(
                info, pki.decode_private_key(owner_key.read_bytes()), int(port)
            )
            async with access.open() as by_key:
                assert [r.node_id for r in await by_key.nodes()] == [n2.node_id, n3.node_id]

        for proc in procs[1:]:
            assert proc.process.returncode == 0
