"""Disaster recovery: every node and every etcd data folder lost, one snapshot left.

Three nodes (each its own process, real etcd, on 127.0.0.1/2/3 with free
ports): n1 and n2 ConsensusMember, n3 KubernetesController. A snapshot
(``recover`` refused while n1, or n3 without etcd, runs); every node killed and every etcd
data folder deleted. A snapshot of another cluster (its manifest names
another CA, which is what the check compares) and a cut one are refused,
the root untouched. ``node
recover`` on n1, ``node run`` on n2 and n3: the owner sees the three
nodes with their roles, n2 a voter again, and the recovery's record.
``node recover`` starts etcdctl before it imports Trio or any wire stack
(its ``-X importtime`` lines before its "restoring" line): they are
imported while etcdctl runs.

Run twice: n1 lost its peer PKI too (a temporary etcd prepares the
restored data), or kept it (none runs: its own etcd starts on the restored
data and its curator prepares it before it campaigns; n2 rejoins all the
same). On one node that kept it, its etcd data deleted: cut after the
mark but before the data is in place, the node refuses to run (one line)
and ``node recover`` again works; cut after the preparation but before the
mark went, ``node run`` prepares again and the recovery is recorded once.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio

from metropolis import pki
from metropolis.consensus.localetcd import etcd_pid
from metropolis.consensus.snapshot import manifest_path
from metropolis.crashpoint import CRASH_ENV
from metropolis.localstorage import Root
from metropolis.owner import open_owner
from metropolis.roleserve import recoverpending
from tests.metropolis.test_cluster import (
    ADDRESSES,
    _members,
    _owner_cli,
    _rows,
    _until,
    approve_registered,
    three_nodes,
)
from tests.metropolis.test_node_cli import LEADS, NodeProcess, bootstrap_args, node
from tests.test_cli_imports import imported

BOUND = 120


async def _cli(*args: str) -> subprocess.CompletedProcess[bytes]:
    return await trio.run_process(
        [sys.executable, "-m", "metropolis", *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )


def _listing(root: Root) -> dict[str, str]:
    """Every file under ``root`` and its SHA-256 (sockets and the like skipped)."""
    found = {}
    for directory, _, files in os.walk(root.path):
        for name in files:
            path = Path(directory, name)
            if path.is_file() and not path.is_symlink():
                found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


@pytest.mark.parametrize("peer_pki", ["lost", "kept"])
async def test_recover_from_a_snapshot_after_losing_every_node(
    tmp_path: Path, peer_pki: str
) -> None:
    with trio.fail_after(BOUND):
        async with three_nodes(tmp_path) as (procs, roots, owner_key):
            key = pki.decode_private_key(owner_key.read_bytes())
            async with open_owner(roots[0], key) as owner:
                n1, n2, n3 = await approve_registered(owner)
                await owner.set_roles(n2.node_id, consensus_member=True)
                await owner.set_roles(n3.node_id, kubernetes_controller=True)

                async def two_voters() -> bool:
                    members = await _members(roots[0])
                    return len(members) == 2 and not any(m.is_learner for m in members)

                await _until(two_voters)
                before = {a: r.roles for a, r in (await _rows(owner)).items()}
                ticket = await owner.ticket()
            old_members = {m.name: m.id for m in await _members(roots[0])}
            assert before[ADDRESSES[1]] == ("ConsensusMember",)
            assert before[ADDRESSES[2]] == ("KubernetesController",)

            snapshot = tmp_path / "cluster.snap"
            owner_args = ("owner", "--root", str(roots[0].path), "--owner-key", str(owner_key))
            made = await _cli(*owner_args, "snapshot", "--out", str(snapshot))
            assert made.returncode == 0, made.stderr.decode()

            recover = ("node", "recover", "--root", str(roots[0].path), "--snapshot")
            running = await _cli(*recover, str(snapshot))
            assert running.returncode == 2
            assert "an etcd member runs" in running.stderr.decode()
            # n3 runs no etcd: its debug port tells that it runs.
            n3_runs = await _cli(
                *recover[:2], "--root", str(roots[2].path), "--snapshot", str(snapshot)
            )
            assert n3_runs.returncode == 2
            assert "debug port" in n3_runs.stderr.decode()

            # The disaster: every node killed, every etcd data folder gone.
            for proc in procs:
                proc.process.kill()
            for proc, root in zip(procs, roots, strict=True):
                await proc.process.wait()
                await _until(functools.partial(_no_etcd, root))
                if root.data.etcd.data.exists():  # n3 had no etcd member
                    shutil.rmtree(root.data.etcd.data)
            if peer_pki == "lost":  # n1 lost its peer PKI and CRL too: all of etcd's folder
                shutil.rmtree(roots[0].data.etcd.path)

            # Refused, and nothing changed: another cluster's, and a cut one.
            foreign = tmp_path / "foreign.snap"
            shutil.copyfile(snapshot, foreign)
            meta = json.loads(manifest_path(snapshot).read_bytes())
            manifest_path(foreign).write_text(json.dumps(meta | {"cluster_ca_sha256": "ab" * 32}))
            cut = tmp_path / "cut.snap"
            cut.write_bytes(snapshot.read_bytes()[:-1000])
            shutil.copyfile(manifest_path(snapshot), manifest_path(cut))
            untouched = _listing(roots[0])
            for bad, why in ((foreign, "another cluster"), (cut, "cut or grown")):
                refused = await _cli(*recover, str(bad))
                assert refused.returncode == 2, refused.stderr.decode()
                assert why in refused.stderr.decode()
                assert _listing(roots[0]) == untouched

            async with AsyncExitStack() as stack:
                first = await stack.enter_async_context(
                    node(*recover[1:], str(snapshot), env={"PYTHONPROFILEIMPORTTIME": "1"})
                )
                back = [first]
                stack.callback(_save_logs, tmp_path, back)
                await first.wait_for(LEADS)
                assert first.logged("recovered from")
                assert first.logged("temporary etcd") == (peer_pki == "lost")
                # With its PKI, its etcd started as the data was in place, and
                # the node took it over (metropolis.consensus.child).
                assert first.logged("taking over etcd started ahead") == (peer_pki == "kept")
                assert _before_etcdctl(first.lines) & _LATER == set()
                for root in roots[1:]:
                    back.append(
                        await stack.enter_async_context(node("run", "--root", str(root.path)))
                    )
                stack.callback(_stop, back)
                async with open_owner(roots[0], key) as owner:

                    async def as_before() -> bool:
                        rows = await _rows(owner)
                        return (
                            {a: r.roles for a, r in rows.items()} == before
                            and rows[ADDRESSES[1]].etcd == "voter"
                            and rows[ADDRESSES[0]].etcd == "voter"
                        )

                    await _until(as_before)
                    assert await owner.ticket() == ticket
                # n2's old member was dropped: it is a new one. (n1's restored
                # member has its old ID: etcd derives it from the peer URL.)
                members = {m.name: m for m in await _members(roots[0])}
                assert members.keys() == old_members.keys()
                assert not any(m.is_learner for m in members.values())
                assert members[n2.node_id].id != old_members[n2.node_id]
                shown = await _owner_cli(roots[0], owner_key, "recoveries")
                # Who recovered, from which revision; n2 rejoined (n3 held no member).
                assert f"{n1.node_id} recovered from snapshot revision {meta['revision']}" in shown
                assert f"rejoining: {n2.node_id}\n" in shown


async def test_a_node_with_its_peer_pki_recovers_without_a_temporary_etcd(
    tmp_path: Path,
) -> None:
    root = Root(tmp_path / "n")
    owner_key = tmp_path / "owner.pem"
    snapshot = tmp_path / "cluster.snap"
    recover = ("recover", "--root", str(root.path), "--snapshot", str(snapshot))
    with trio.fail_after(BOUND):
        async with node(*bootstrap_args(tmp_path)) as first:
            await first.wait_for(LEADS)
            key = pki.decode_private_key(owner_key.read_bytes())
            async with open_owner(root, key) as owner:
                ticket = await owner.ticket()
            owner_args = ("owner", "--root", str(root.path), "--owner-key", str(owner_key))
            made = await _cli(*owner_args, "snapshot", "--out", str(snapshot))
            assert made.returncode == 0, made.stderr.decode()
            first.process.kill()
        await _until(functools.partial(_no_etcd, root))
        shutil.rmtree(root.data.etcd.data)

        # Cut once the mark is written, before the restored data is in place.
        async with node(*recover, env={CRASH_ENV: "recover-marked"}) as cut:
            pass
        assert cut.process.returncode == -signal.SIGKILL
        assert recoverpending.path(root).exists() and not root.data.etcd.data.exists()
        refused = await _cli("node", "run", "--root", str(root.path))
        assert refused.returncode == 2
        [line] = refused.stderr.decode().strip().splitlines()
        assert "run node recover again" in line

        # Cut once the keyspace is prepared, before the mark goes.
        async with node(*recover, env={CRASH_ENV: "recover-prepared"}) as cut:
            pass
        assert cut.process.returncode == -signal.SIGKILL
        assert not cut.logged("temporary etcd")
        assert not any("recover.etcd" in line for line in cut.lines)
        await _until(functools.partial(_no_etcd, root))
        assert recoverpending.path(root).exists()
        async with node("run", "--root", str(root.path)) as resumed:
            await resumed.wait_for(LEADS)
            assert resumed.logged("recovered from")
            assert not recoverpending.path(root).exists()
            async with open_owner(root, key) as owner:
                assert await owner.ticket() == ticket
            shown = await _owner_cli(root, owner_key, "recoveries")
            resumed.process.send_signal(signal.SIGTERM)
    assert len(shown.strip().splitlines()) == 1, shown
    assert "recovered from snapshot revision" in shown


#: Packages ``node recover`` imports only once etcdctl runs: Trio, the
#: node's HTTP/2 and gRPC stacks, the etcd gateway's client.
_LATER = {"trio", "h2", "hpack", "hyperframe", "grpclib", "httpx", "httpcore"}


def _before_etcdctl(lines: list[str]) -> set[str]:
    """The top-level packages a node's ``-X importtime`` lines name before its
    "restoring" line (logged as it starts etcdctl)."""
    start = next(i for i, line in enumerate(lines) if "restoring" in line)
    return {name.split(".")[0] for name in imported("\n".join(lines[:start]))}


async def _no_etcd(root: Root) -> bool:
    return etcd_pid(root.ephemeral.consensus) is None


def _save_logs(tmp_path: Path, procs: list[NodeProcess]) -> None:
    for i, proc in enumerate(procs, 1):
        (tmp_path / f"recovered-n{i}.log").write_text("\n".join(proc.lines))


def _stop(procs: list[NodeProcess]) -> None:
    for proc in procs:
        if proc.process.returncode is None:
            proc.process.send_signal(signal.SIGTERM)
