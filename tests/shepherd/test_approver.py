"""The Shepherd's approver against a real cluster node and a real BMDB.

A node bootstraps a cluster (its own process, real etcd); keys register
with the cluster's ticket (RegisterNode with a proof of possession, as a
registering node calls it) and wait NEW. Machines in the BMDB carry
installation requests and reports of several kinds. Only the node whose
key a machine's agent reported in a successful installation of the
generation now requested is approved; running the approver again changes
nothing; a report for the current generation, once stored, is approved
by the running loop.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import bmdb
from bmdb import Provider, Queries
from bmdb.actions import act
from common.net import free_loopback_port
from metropolis import identity, pki
from metropolis.localstorage import Root
from metropolis.owner import OwnerAccess, load_owner
from metropolis.proto import curator_api as c
from metropolis.proto.management import GetClusterInfoResponse
from metropolis.rpc import client_context, endpoints_from_directory, methods, open_client
from shepherd.approver import Approver, run_approver
from shepherd.cli import build_parser, validate_options
from shepherd.proto.agent_callback import (
    OsInstallationReport,
    OsInstallationReportError,
    OsInstallationReportSuccess,
    OsInstallationRequest,
)
from tests.metropolis.test_node_cli import LEADS, node

BOUND = 120


@dataclass
class Cluster:
    seed: Root
    owner_key: Path
    access: OwnerAccess
    info: GetClusterInfoResponse
    ticket: bytes
    curator_port: int


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    seed = Root(tmp_path / "seed")
    owner_key = tmp_path / "owner.pem"
    curator_port = free_loopback_port()
    with trio.fail_after(BOUND):
        async with node(
            *("bootstrap", "--root", str(seed.path), "--address", "127.0.0.1"),
            *("--owner-key-out", str(owner_key), "--insecure-seal", "--raft-tuning", "20,200"),
            *("--peer-port", str(free_loopback_port()), "--curator-port", str(curator_port)),
            *("--debug-port", str(free_loopback_port())),
        ) as first:
            await first.wait_for(LEADS)
            await first.wait_for("status pushed")
            access = load_owner(seed, pki.decode_private_key(owner_key.read_bytes()))
            async with access.open() as owner:
                info = await owner.info()
                ticket = await owner.ticket()
            yield Cluster(seed, owner_key, access, info, ticket, curator_port)
            first.process.send_signal(signal.SIGTERM)


async def _register(cluster: Cluster, key: Ed25519PrivateKey | None = None) -> bytes:
    """A new node registers (and stays NEW); its public key."""
    key, join = key or pki.generate_key(), pki.generate_key()
    assert cluster.info.cluster_directory is not None
    endpoints = endpoints_from_directory(cluster.info.cluster_directory, cluster.curator_port)
    ca = pki.decode_certificate(cluster.info.ca_certificate)
    async with open_client(endpoints, client_context(ca), proof_key=key) as client:
        await client.unary(
            methods.REGISTER_NODE,
            c.RegisterNodeRequest(
                register_ticket=cluster.ticket, join_key=pki.public_key_bytes(join)
            ),
        )
    return pki.public_key_bytes(key)


def _success(generation: int, key: bytes) -> bytes:
    return bytes(
        OsInstallationReport(
            generation=generation, success=OsInstallationReportSuccess(node_public_key=key)
        )
    )


def _error(generation: int, cause: str) -> bytes:
    return bytes(
        OsInstallationReport(generation=generation, error=OsInstallationReportError(error=cause))
    )


async def _machine(
    conn: bmdb.Connection,
    name: str,
    requested: int,
    reported: int | None,
    report: bytes,
    *,
    provided: bool = True,
) -> uuid.UUID:
    async def body(q: Queries) -> uuid.UUID:
        machine = await q.new_machine()
        if provided:
            await q.add_provided(machine, Provider.STATIC, name, address=f"10.0.0.{len(name)}")
        request = bytes(OsInstallationRequest(generation=requested))
        await q.set_os_installation_request(machine, requested, request)
        if reported is not None:
            await q.set_os_installation_report(machine, reported, report)
        return machine

    return await conn.transact(body)


async def _states(cluster: Cluster) -> dict[bytes, str]:
    async with cluster.access.open() as owner:
        return {row.public_key: row.state for row in await owner.nodes()}


async def test_only_nodes_installed_at_the_requested_generation_are_approved(
    cluster: Cluster, bmdb_conn: bmdb.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="shepherd.approver")
    with trio.fail_after(BOUND):
        installed, failed, crafted, unknown, old, twisted = [
            await _register(cluster) for _ in range(6)
        ]
        ok = await _machine(bmdb_conn, "ok", 1, 1, _success(1, installed))
        # The node of a machine whose install failed: the error carries no key.
        await _machine(bmdb_conn, "failed", 1, 1, _error(1, "disk full"))
        # A report holding a key and an error both is not a report at all.
        both = _success(1, crafted) + _error(1, "no")[2:]
        await _machine(bmdb_conn, "both", 1, 1, both)
        # Reported for generation 1; the machine has since been asked for 2.
        reinstalled = await _machine(bmdb_conn, "reinstall", 2, 1, _success(1, old))
        # Stored as generation 1, but the report itself says 2.
        await _machine(bmdb_conn, "twisted", 1, 1, _success(2, twisted))
        # A machine with a request and no report yet.
        await _machine(bmdb_conn, "pending", 1, None, b"")

        approver = Approver(cluster.access, bmdb_conn)
        approved = await approver.round()
        assert [a.node_id for a in approved] == [identity.node_id(installed)]
        assert approved[0].machine.machine_id == ok
        assert approved[0].machine.generation == 1
        states = await _states(cluster)
        assert states[installed] == "STANDBY"
        for key in (failed, crafted, unknown, old, twisted):
            assert states[key] == "NEW"

        # Again: nothing changes, and nothing is approved twice.
        assert await approver.round() == []
        assert await _states(cluster) == states
        refused = [r.getMessage() for r in caplog.records if "not approving" in r.getMessage()]
        for key in (failed, crafted, unknown, old, twisted):
            mentions = [line for line in refused if identity.node_id(key) in line]
            assert len(mentions) == 1, refused
        assert not any(identity.node_id(installed) in line for line in refused)

        # The reinstall succeeds: the loop approves its node.
        async def report(q: Queries) -> None:
            await q.set_os_installation_report(reinstalled, 2, _success(2, old))

        await bmdb_conn.transact(report)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_approver, cluster.access, bmdb_conn, 0.1)
            # Polling: the approval happens in the curator, nothing here is told.
            while (await _states(cluster))[old] == "NEW":  # noqa: ASYNC110
                await trio.sleep(0.1)
            nursery.cancel_scope.cancel()
        states = await _states(cluster)
        assert states[old] == "STANDBY"
        for key in (failed, crafted, unknown, twisted):
            assert states[key] == "NEW"


async def test_one_key_reported_by_two_machines_is_not_approved(
    cluster: Cluster, bmdb_conn: bmdb.Connection
) -> None:
    with trio.fail_after(BOUND):
        key = await _register(cluster)
        await _machine(bmdb_conn, "a", 1, 1, _success(1, key))
        await _machine(bmdb_conn, "bb", 3, 3, _success(3, key))
        assert await Approver(cluster.access, bmdb_conn).round() == []
        assert (await _states(cluster))[key] == "NEW"


def _shepherd_args(tmp_path: Path, *extra: str) -> list[str]:
    machines = tmp_path / "machines.toml"
    machines.write_text('[[machine]]\nid = "m-1"\naddress = "127.0.0.1"\n')
    return [
        *("--bmdb-url", "postgresql:///bmdb", "--provider", "static"),
        *("--static-machines-path", str(machines), "--ssh-key-path", str(tmp_path / "id")),
        *("--agent-endpoint", "bmaas.example:443", *extra),
    ]


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--approve-installed"], "--approve-installed needs --cluster-owner-key with"),
        (["--cluster-owner-root", "X"], "--cluster-owner-info needs --cluster-owner-key"),
        (["--cluster-owner-key", "X"], "needs --cluster-owner-root or --cluster-owner-info"),
        (
            ["--cluster-owner-root", "X", "--cluster-owner-info", "X", "--cluster-owner-key", "X"],
            "exclude each other",
        ),
        (
            ["--approve-installed", "--cluster-owner-root", "X", "--cluster-owner-key", "X"],
            "the cluster owner's credentials: cannot read the owner key",
        ),
        (
            ["--cluster-owner-info", "X", "--cluster-owner-key", "X"],
            "the cluster owner's credentials: cannot read the owner key",
        ),
    ],
)
def test_approver_flags_are_checked_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], expected: str
) -> None:
    parser = build_parser()
    argv = _shepherd_args(tmp_path, *(str(tmp_path / "none") if e == "X" else e for e in extra))
    with pytest.raises(SystemExit) as exit_:
        validate_options(parser, parser.parse_args(argv))
    assert exit_.value.code == 2
    assert expected in capsys.readouterr().err
    # Refused before the SSH key would be generated.
    assert not (tmp_path / "id").exists()


async def test_approver_flags_give_the_owner_access(tmp_path: Path, cluster: Cluster) -> None:
    parser = build_parser()
    argv = _shepherd_args(
        tmp_path,
        *("--approve-installed", "--cluster-owner-root", str(cluster.seed.path)),
        *("--cluster-owner-key", str(cluster.owner_key), "--approve-interval", "2s"),
    )
    options = validate_options(parser, parser.parse_args(argv))
    assert options.approver is not None
    assert options.approver.interval == 2.0
    assert [e.address for e in options.approver.access.endpoints] == [
        e.address for e in cluster.access.endpoints
    ]
    assert options.owner is options.approver.access  # the decommissioner's too
    without = validate_options(parser, parser.parse_args(_shepherd_args(tmp_path)))
    assert without.approver is None and without.owner is None
    # The cluster file instead of a root, without the approver: the
    # decommissioner alone gets the credentials (escrowed at first use).
    info = tmp_path / "cluster.pb"
    info.write_bytes(bytes(cluster.info))
    argv = _shepherd_args(
        tmp_path, "--cluster-owner-info", str(info), "--cluster-owner-key", str(cluster.owner_key)
    )
    by_file = validate_options(parser, parser.parse_args(argv))
    assert by_file.approver is None and by_file.owner is not None
    assert by_file.owner.certificate is None
    assert by_file.owner.ca_certificate == cluster.access.ca_certificate
    assert [e.host for e in by_file.owner.endpoints] == [e.host for e in cluster.access.endpoints]


async def test_python_m_shepherd_approve_installed_runs_the_approver(
    tmp_path: Path, cluster: Cluster, bmdb_conn: bmdb.Connection, bmdb_url: str
) -> None:
    with trio.fail_after(BOUND):
        installed, unknown = await _register(cluster), await _register(cluster)
        # Not one of the static provider's machines: the provisioner leaves it be.
        await _machine(bmdb_conn, "x", 1, 1, _success(1, installed), provided=False)
        argv = _shepherd_args(
            tmp_path,
            *("--approve-installed", "--cluster-owner-root", str(cluster.seed.path)),
            *("--cluster-owner-key", str(cluster.owner_key), "--approve-interval", "100ms"),
        )
        argv[argv.index("--bmdb-url") + 1] = bmdb_url
        log = tmp_path / "shepherd.log"
        with log.open("wb") as out:
            process = await trio.lowlevel.open_process(
                [sys.executable, "-m", "shepherd", *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            try:
                # Polling: the approval happens in other processes.
                while (await _states(cluster))[installed] == "NEW":  # noqa: ASYNC110
                    await trio.sleep(0.1)
                process.send_signal(signal.SIGTERM)
                assert await process.wait() == 0
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()
        assert (await _states(cluster))[unknown] == "NEW"
        text = log.read_text()
        assert f"approved {identity.node_id(installed)}, installed on machine" in text
        assert f"not approving {identity.node_id(unknown)}" in text


async def test_a_decommissioning_machine_s_node_is_not_approved(
    cluster: Cluster, bmdb_conn: bmdb.Connection
) -> None:
    """The decommissioner removes that node from the cluster: approving it
    meanwhile would admit a node about to be wiped."""
    with trio.fail_after(BOUND):
        leaving, staying = await _register(cluster), await _register(cluster)
        machine = await _machine(bmdb_conn, "leaving", 1, 1, _success(1, leaving))
        await _machine(bmdb_conn, "staying", 1, 1, _success(1, staying))
        await act(bmdb_conn, "decommission", machine, operator="op", reason="retire")
        approved = await Approver(cluster.access, bmdb_conn).round()
        assert [a.node_id for a in approved] == [identity.node_id(staying)]
        assert (await _states(cluster))[leaving] == "NEW"


async def test_a_stored_report_wakes_the_approver(
    cluster: Cluster, bmdb_conn: bmdb.Connection
) -> None:
    """With an interval longer than the test's bound, only the report's
    notification can have the node approved: once registered before its
    report, once after it (the node calls the cluster after it announced
    its key, which its agent reports)."""
    approver = Approver(cluster.access, bmdb_conn)
    with trio.fail_after(BOUND):
        first = await _register(cluster)
        machine = await _machine(bmdb_conn, "first", 1, None, b"")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(approver.serve, 3600.0)
            while approver.rounds < 1:  # noqa: ASYNC110 (the first round, before the report)
                await trio.sleep(0.05)
            await bmdb_conn.transact(
                lambda q: q.record_os_installation_report(
                    machine, 1, _success(1, first), True, None, first
                )
            )
            while (await _states(cluster))[first] == "NEW":  # noqa: ASYNC110 (the curator's)
                await trio.sleep(0.1)

            # Reported first, registered after: the quick rounds find it.
            second = pki.generate_key()
            public = pki.public_key_bytes(second)
            machine = await _machine(bmdb_conn, "second", 1, None, b"")
            rounds = approver.rounds
            await bmdb_conn.transact(
                lambda q: q.record_os_installation_report(
                    machine, 1, _success(1, public), True, None, public
                )
            )
            # A round after the report's own has begun: the report was
            # seen before the node registered.
            while approver.rounds < rounds + 2:  # noqa: ASYNC110 (the approver's rounds)
                await trio.sleep(0.05)
            await _register(cluster, second)
            while (await _states(cluster))[public] == "NEW":  # noqa: ASYNC110 (the curator's)
                await trio.sleep(0.1)
            nursery.cancel_scope.cancel()
