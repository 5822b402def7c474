"""``python -m shepherd install``: requests with new generations, written
in one transaction, and a line for every machine it refuses (nothing
written for it); the BMDB views then show installing / installed /
install failed as the agent callback server records reports."""

from __future__ import annotations

import datetime
import hashlib
import http.server
import ipaddress
import json
import re
import socket
import ssl
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ec import SECP256R1, generate_private_key
from cryptography.x509.oid import NameOID

import bmdb
from bmdb import Provider
from bmdb.metrics import fleet_snapshot
from bmdb.model import InstallState, OSInstallation, Queries
from common.protobuf import parse_strict
from metropolis import identity, pki
from metropolis.proto import common, configuration, parameters
from metropolis.proto.management import GetClusterInfoResponse
from shepherd.install import ImageRef, Plan, install
from shepherd.proto.agent_callback import (
    AgentHardwareReport,
    OsInstallationReport,
    OsInstallationReportError,
    OsInstallationReportSuccess,
    OsInstallationRequest,
)
from shepherd.proto.hwreport import BlockDevice, Node
from tests.bmdb.helpers import add_provided_machines
from tests.bmdb.test_cli import cli as bmdb_cli

IMAGE = b"the node image\n" * 100
SHA = hashlib.sha256(IMAGE).hexdigest()
NODE_KEY = bytes(range(32))


class _ImageHandler(http.server.BaseHTTPRequestHandler):
    """Serves IMAGE at /images/sha256/SHA, 404 for anything else."""

    def _answer(self, body: bool) -> None:
        if self.path != f"/images/sha256/{SHA}":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(IMAGE)))
        self.end_headers()
        if body:
            self.wfile.write(IMAGE)

    def do_HEAD(self) -> None:
        self._answer(False)

    def do_GET(self) -> None:
        self._answer(True)

    def log_message(self, format: str, *args: object) -> None:
        pass


def _serve(context: ssl.SSLContext | None = None) -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ImageHandler)
    if context is not None:
        server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
def image_server() -> Iterator[str]:
    """HOST:PORT of a plain-HTTP image server that has IMAGE."""
    yield from _serve()


@dataclass
class Cluster:
    info: Path
    owner: Path
    ticket: str
    owner_public: bytes


@pytest.fixture
def cluster(tmp_path: Path) -> Cluster:
    ca = pki.new_ca(pki.generate_key(), "cluster CA")
    info = GetClusterInfoResponse(
        cluster_directory=common.ClusterDirectory(
            nodes=[
                common.ClusterDirectoryNode(
                    public_key=pki.public_key_bytes(pki.generate_key()),
                    addresses=[common.ClusterDirectoryNodeAddress(host="127.0.0.1")],
                )
            ]
        ),
        ca_certificate=pki.encode_certificate(ca, pki.Encoding.DER),
    )
    (tmp_path / "cluster.pb").write_bytes(bytes(info))
    owner = pki.generate_key()
    (tmp_path / "owner.pem").write_bytes(pki.encode_private_key(owner))
    return Cluster(
        tmp_path / "cluster.pb", tmp_path / "owner.pem", "ab" * 16, pki.public_key_bytes(owner)
    )


async def shepherd_install(*args: str) -> tuple[int, str, str]:
    result = await trio.run_process(
        [sys.executable, "-m", "shepherd", "install", *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    return result.returncode, result.stdout.decode(), result.stderr.decode()


def _args(
    url: str, cluster: Cluster, server: str, *machines: uuid.UUID, device: str = "disk0"
) -> list[str]:
    out = ["--bmdb-url", url]
    for m in machines:
        out += ["--machine", str(m)]
    return [
        *out,
        "--cluster-info", str(cluster.info), "--ticket", cluster.ticket,
        "--owner-public-key", str(cluster.owner),
        "--image-url", f"http://{server}/images/sha256/{SHA}", "--insecure-plain-http",
        "--root-device", device,
    ]  # fmt: skip


def _report(*devices: str) -> bytes:
    return bytes(
        AgentHardwareReport(
            report=Node(
                block_device=[BlockDevice(serial_number=d, capacity_bytes=1) for d in devices]
            )
        )
    )


async def _machines(
    conn: bmdb.Connection, count: int, *, without_report: int = 0
) -> list[uuid.UUID]:
    """``count`` provided machines (addresses 10.0.0.0 up), all but the last
    ``without_report`` with a hardware report listing disk0 and disk1."""
    ids = await add_provided_machines(conn, count)

    async def fn(q: Queries) -> None:
        for mid in ids[: count - without_report]:
            await q.set_hardware_report(mid, _report("disk0", "disk1"))

    await conn.transact(fn)
    return ids


async def _installation(conn: bmdb.Connection, mid: uuid.UUID) -> OSInstallation | None:
    async def fn(q: Queries) -> OSInstallation | None:
        return await q.os_installation(mid)

    return await conn.transact(fn)


async def _raw_request(conn: bmdb.Connection, mid: uuid.UUID) -> OsInstallationRequest:
    async def fn(q: Queries) -> bytes:
        rows = await q.execute(
            "SELECT os_installation_request_raw FROM machine_os_installation_request "
            "WHERE machine_id = %s",
            (mid,),
        )
        return bytes(rows[0][0])

    return parse_strict(OsInstallationRequest, await conn.transact(fn))


async def _record(
    conn: bmdb.Connection, mid: uuid.UUID, generation: int, error: str | None = None
) -> bool:
    """Store a report the way the agent callback server does."""
    report = OsInstallationReport(generation=generation)
    if error is None:
        report.success = OsInstallationReportSuccess(node_public_key=NODE_KEY)
    else:
        report.error = OsInstallationReportError(error=error)

    async def fn(q: Queries) -> bool:
        return await q.record_os_installation_report(
            mid, generation, bytes(report), error is None, error, None if error else NODE_KEY
        )

    return await conn.transact(fn)


async def test_generation_one_then_two(
    bmdb_conn: bmdb.Connection, bmdb_url: str, cluster: Cluster, image_server: str
) -> None:
    [a, b] = await _machines(bmdb_conn, 2)
    code, out, err = await shepherd_install(*_args(bmdb_url, cluster, image_server, a, b))
    assert (code, err) == (0, ""), out
    lines = out.splitlines()
    assert lines[0] == f"requested {a} generation 1 root device disk0 node address 10.0.0.0"
    assert lines[1] == f"requested {b} generation 1 root device disk0 node address 10.0.0.1"
    assert lines[2] == "2 machine(s): 2 requested, 0 refused"

    request = await _raw_request(bmdb_conn, a)
    assert request.generation == 1 and request.metropolis is not None
    m = request.metropolis
    assert (m.root_device, m.node_address) == ("disk0", "10.0.0.0")
    assert m.node_parameters is not None and m.os_image is not None
    params = parameters.decode(m.node_parameters, "request")
    assert params.cluster_register is not None
    assert params.cluster_register.register_ticket == bytes.fromhex(cluster.ticket)
    assert params.cluster_register.owner_public_key == cluster.owner_public
    assert parse_strict(configuration.OsImageRef, m.os_image) == configuration.OsImageRef(
        scheme="http", host=image_server, repository="metropolis-node", digest=f"sha256:{SHA}"
    )
    stored = await _installation(bmdb_conn, a)
    assert stored is not None and stored.image_digest == f"sha256:{SHA}"
    assert stored.state is InstallState.INSTALLING

    # a installed, b failed: a is refused without --reinstall; b installs again.
    assert await _record(bmdb_conn, a, 1)
    assert await _record(bmdb_conn, b, 1, error="no space left")
    code, out, _ = await shepherd_install(*_args(bmdb_url, cluster, image_server, a, b))
    assert code == 1
    node = identity.node_id(NODE_KEY)
    assert out.splitlines() == [
        f"refused {a}: already installed at generation 1 as {node} (--reinstall installs again)",
        f"requested {b} generation 2 root device disk0 node address 10.0.0.1",
        "2 machine(s): 1 requested, 1 refused",
    ]
    installed = await _installation(bmdb_conn, a)
    assert installed is not None and installed.generation == 1
    assert installed.state is InstallState.INSTALLED
    again = await _installation(bmdb_conn, b)
    assert again is not None and (again.generation, again.state) == (2, InstallState.INSTALLING)
    assert (await _raw_request(bmdb_conn, b)).generation == 2

    code, out, _ = await shepherd_install(
        *_args(bmdb_url, cluster, image_server, a, device="disk1"), "--reinstall"
    )
    assert code == 0, out
    assert out.splitlines()[0] == (
        f"requested {a} generation 2 root device disk1 node address 10.0.0.0"
    )
    reinstalled = await _installation(bmdb_conn, a)
    assert reinstalled is not None
    assert (reinstalled.generation, reinstalled.root_device) == (2, "disk1")


async def test_every_refusal_has_its_line_and_writes_nothing(
    bmdb_conn: bmdb.Connection, bmdb_url: str, cluster: Cluster, image_server: str
) -> None:
    [good, listed_not, installing, no_report] = await _machines(bmdb_conn, 4, without_report=1)
    missing = uuid.uuid4()

    async def prepare(q: Queries) -> tuple[uuid.UUID, uuid.UUID]:
        unprovided = await q.new_machine()
        await q.set_hardware_report(unprovided, _report("disk0"))
        garbled = await q.new_machine()
        await q.add_provided(garbled, Provider.STATIC, "garbled", "10.0.1.1")
        await q.set_hardware_report(garbled, b"\x0a\xff\xff")
        await q.set_hardware_report(listed_not, _report("nvme0n1"))
        await q.set_os_installation_request(
            installing, 4, b"r", root_device="disk0", image_digest="sha256:00", node_address="x"
        )
        return unprovided, garbled

    unprovided, garbled = await bmdb_conn.transact(prepare)
    machines = (good, listed_not, installing, no_report, missing, unprovided, garbled)
    code, out, err = await shepherd_install(*_args(bmdb_url, cluster, image_server, *machines))
    assert code == 1 and err == ""
    lines = out.splitlines()
    lines[-2] = lines[-2][: lines[-2].index("AgentHardwareReport") + len("AgentHardwareReport")]
    assert lines == [
        f"requested {good} generation 1 root device disk0 node address 10.0.0.0",
        f"refused {listed_not}: root device 'disk0' is not in its hardware report "
        "(it lists: nvme0n1)",
        f"refused {installing}: generation 4 is still installing, not reported yet "
        "(--reinstall replaces it)",
        f"refused {no_report}: no hardware report yet (its agent has not sent one)",
        f"refused {missing}: no such machine",
        f"refused {unprovided}: no provider address, which the node would be started with",
        # The parser's own words follow (common.protobuf says what is wrong).
        f"refused {garbled}: its stored hardware report does not decode: AgentHardwareReport",
        "7 machine(s): 1 requested, 6 refused",
    ]
    for refused in (listed_not, no_report, unprovided, garbled):
        assert await _installation(bmdb_conn, refused) is None
    kept = await _installation(bmdb_conn, installing)
    assert kept is not None and kept.generation == 4


async def test_an_image_the_server_does_not_have_refuses_the_run(
    bmdb_conn: bmdb.Connection, bmdb_url: str, cluster: Cluster, image_server: str
) -> None:
    [mid] = await _machines(bmdb_conn, 1)
    args = _args(bmdb_url, cluster, image_server, mid)
    other = "0" * 64
    code, out, err = await shepherd_install(*[a.replace(SHA, other) for a in args])
    assert (code, out) == (1, "")
    assert err.strip() == (
        f"shepherd install: error: image server does not have sha256:{other} "
        f"(404 from http://{image_server}/images/sha256/{other})"
    )
    # Nothing listens there any more.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    code, out, err = await shepherd_install(*[a.replace(image_server, closed) for a in args])
    assert (code, out) == (1, "")
    assert err.startswith(f"shepherd install: error: image server unreachable at http://{closed}/")
    assert await _installation(bmdb_conn, mid) is None


async def test_the_image_server_is_checked_against_the_given_ca(
    bmdb_conn: bmdb.Connection, bmdb_url: str, cluster: Cluster, tmp_path: Path
) -> None:
    key = generate_private_key(SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "image server")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    (tmp_path / "ca.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tmp_path / "ca.pem", tmp_path / "key.pem")
    [mid] = await _machines(bmdb_conn, 1)
    for server in _serve(context):
        args = [
            a.replace("http://", "https://")
            for a in _args(bmdb_url, cluster, server, mid)
            if a != "--insecure-plain-http"
        ]
        # The system's CAs do not know this server.
        code, out, err = await shepherd_install(*args, "--dry-run")
        assert (code, out) == (1, "")
        assert "image server unreachable" in err and "CERTIFICATE_VERIFY_FAILED" in err
        code, out, err = await shepherd_install(
            *args, "--image-server-ca", str(tmp_path / "ca.pem")
        )
        assert (code, err) == (0, ""), err
        assert out.splitlines()[0].startswith(f"requested {mid} generation 1")
    installation = await _installation(bmdb_conn, mid)
    assert installation is not None and installation.generation == 1


async def test_dry_run_writes_nothing(
    bmdb_conn: bmdb.Connection, bmdb_url: str, cluster: Cluster, image_server: str
) -> None:
    [mid] = await _machines(bmdb_conn, 1)
    code, out, err = await shepherd_install(
        *_args(bmdb_url, cluster, image_server, mid), "--dry-run"
    )
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        f"would request {mid} generation 1 root device disk0 node address 10.0.0.0",
        "1 machine(s): 1 would be requested, 0 refused (dry run: nothing written)",
    ]
    assert await _installation(bmdb_conn, mid) is None


async def test_machines_chosen_by_state_and_count(
    bmdb_conn: bmdb.Connection, bmdb_url: str, cluster: Cluster, image_server: str
) -> None:
    ids = await _machines(bmdb_conn, 4)
    now = datetime.datetime.now(datetime.UTC)

    async def beat(q: Queries) -> None:
        for mid in ids[1:]:
            await q.set_agent_started(mid, now, b"k" * 32)
            await q.set_agent_heartbeat(mid, now)

    await bmdb_conn.transact(beat)
    base = _args(bmdb_url, cluster, image_server)
    code, out, _ = await shepherd_install(*base, "--state", "heartbeating", "--count", "2")
    assert code == 0, out
    assert [line.split()[1] for line in out.splitlines()[:2]] == [str(ids[1]), str(ids[2])]
    # The installation states choose too: the two installing ones, refused.
    code, out, _ = await shepherd_install(*base, "--state", "installing", "--count", "5")
    assert code == 1
    assert out.splitlines()[-1] == "2 machine(s): 0 requested, 2 refused"
    code, _, err = await shepherd_install(*base, "--state", "installed", "--count", "1")
    assert (code, err.strip()) == (1, "shepherd install: error: no machines in state installed")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("--ticket", "zz"), "argument --ticket: want the ticket as hex"),
        (("--ticket", ""), "argument --ticket: want the ticket as hex"),
        (("--root-device", "../../etc"), "argument --root-device: '../../etc' is not a device"),
        (("--root-device", "/dev/sda"), "argument --root-device: '/dev/sda' is not a device"),
        (("--count", "0"), "argument --count: want a count from 1"),
    ],
)
async def test_hostile_options_are_refused_with_a_cause(
    bmdb_conn: bmdb.Connection,
    bmdb_url: str,
    cluster: Cluster,
    image_server: str,
    change: tuple[str, str],
    message: str,
) -> None:
    [mid] = await _machines(bmdb_conn, 1)
    args = _args(bmdb_url, cluster, image_server, mid)
    flag, value = change
    if flag in args:
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]
    code, out, err = await shepherd_install(*args)
    assert (code, out) == (2, "")
    assert err.splitlines()[-1].startswith(f"shepherd install: error: {message}"), err
    assert await _installation(bmdb_conn, mid) is None


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\xff\x00garbage" * 50, "not a cluster info file"),
        (b"", "no cluster_directory nodes"),
    ],
)
async def test_garbage_cluster_info_and_owner_key_are_refused(
    bmdb_conn: bmdb.Connection,
    bmdb_url: str,
    cluster: Cluster,
    image_server: str,
    tmp_path: Path,
    content: bytes,
    message: str,
) -> None:
    [mid] = await _machines(bmdb_conn, 1)
    cluster.info.write_bytes(content)
    code, _, err = await shepherd_install(*_args(bmdb_url, cluster, image_server, mid))
    assert code == 2 and f"argument --cluster-info: {cluster.info}: {message}" in err, err
    cluster.owner.write_bytes(b"-----BEGIN PRIVATE KEY-----\nnonsense\n-----END PRIVATE KEY-----\n")
    code, _, err = await shepherd_install(*_args(bmdb_url, cluster, image_server, mid))
    assert code == 2 and "argument --owner-public-key:" in err and "not a usable private key" in err
    assert await _installation(bmdb_conn, mid) is None


async def test_views_show_installing_installed_and_failed(
    bmdb_conn: bmdb.Connection, bmdb_url: str, cluster: Cluster, image_server: str
) -> None:
    [ok, bad, waiting, never] = await _machines(bmdb_conn, 4)
    code, out, _ = await shepherd_install(*_args(bmdb_url, cluster, image_server, ok, bad, waiting))
    assert code == 0, out
    assert await _record(bmdb_conn, ok, 1)
    assert await _record(bmdb_conn, bad, 1, error="image digest mismatch\x1b[31m")
    # A report on a generation never requested is dropped.
    assert not await _record(bmdb_conn, waiting, 7)

    code, out, err = await bmdb_cli("--url", bmdb_url, "machines", "--json")
    assert code == 0, err
    by_id = {m["machine_id"]: m for m in json.loads(out)}
    node = identity.node_id(NODE_KEY)
    assert {k: by_id[str(ok)][k] for k in ("install_state", "install_generation", "node_id")} == {
        "install_state": "installed", "install_generation": 1, "node_id": node
    }  # fmt: skip
    assert by_id[str(bad)]["install_state"] == "install-failed"
    assert by_id[str(bad)]["install_cause"] == "image digest mismatch\x1b[31m"
    assert by_id[str(waiting)]["install_state"] == "installing"
    assert by_id[str(never)]["install_state"] is None

    code, out, _ = await bmdb_cli("--url", bmdb_url, "machines", "--state", "install-failed")
    assert code == 0
    [_, row] = out.splitlines()
    assert row.split()[:4] == [str(bad), "needs-agent-start", "install-failed@1", "-"]
    # The agent's cause, escaped: it cannot drive the terminal.
    assert row.endswith("image digest mismatch\\x1b[31m")
    code, out, _ = await bmdb_cli("--url", bmdb_url, "machines", "--state", "installed")
    assert [line.split()[:4] for line in out.splitlines()[1:]] == [
        [str(ok), "needs-agent-start", "installed@1", node]
    ]

    code, out, _ = await bmdb_cli("--url", bmdb_url, "machine", str(ok))
    fields = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    assert fields["install"].strip() == "installed (generation 1)"
    assert fields["install root device"].strip() == "disk0"
    assert fields["install image"].strip() == f"sha256:{SHA}"
    assert fields["install node address"].strip() == "10.0.0.0"
    assert fields["install outcome"].strip() == "success"
    assert fields["install node"].strip() == node
    code, out, _ = await bmdb_cli("--url", bmdb_url, "machine", str(bad))
    fields = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    assert fields["install outcome"].strip() == "error"
    assert fields["install cause"].strip() == "image digest mismatch\\x1b[31m"
    code, out, _ = await bmdb_cli("--url", bmdb_url, "machine", str(waiting), "--json")
    detail = json.loads(out)["installation"]
    assert (detail["state"], detail["generation"], detail["report_generation"]) == (
        "installing", 1, None
    )  # fmt: skip

    snapshot = await fleet_snapshot(bmdb_conn)
    assert snapshot.installation == {"installed": 1, "install-failed": 1, "installing": 1}


async def test_concurrent_runs_never_request_one_generation_twice(
    bmdb_conn: bmdb.Connection, cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs at once on one machine, both reading before either writes:
    one gets generation 1, the other (retried after the serialization
    failure) generation 2; neither is refused."""
    [mid] = await _machines(bmdb_conn, 1)
    both_read = trio.Event()
    reads = 0
    original = Queries.installation_target

    async def read_then_wait(self: Queries, machine_id: uuid.UUID | str) -> object:
        nonlocal reads
        target = await original(self, machine_id)
        reads += 1
        if reads == 2:
            both_read.set()
        if reads <= 2:  # the first attempts only: a retry goes straight on
            with trio.fail_after(10):
                await both_read.wait()
        return target

    monkeypatch.setattr(Queries, "installation_target", read_then_wait)
    info = parameters.read_cluster_info(cluster.info)
    params = parameters.register_parameters(info, b"t", cluster.owner_public)
    generations: list[int | None] = []

    async def run(device: str) -> None:
        plan = Plan(
            parameters.encode(params), ImageRef("https", "h:1", SHA), device, reinstall=True
        )
        [decision] = await install(bmdb_conn, plan, machines=[mid])
        generations.append(decision.generation)

    async with trio.open_nursery() as nursery:
        for device in ("disk0", "disk1"):
            nursery.start_soon(run, device)
    assert sorted(g for g in generations if g is not None) == [1, 2]
    stored = await _installation(bmdb_conn, mid)
    assert stored is not None and stored.generation == 2
    assert (await _raw_request(bmdb_conn, mid)).generation == 2


async def test_help_explains_every_option_with_examples() -> None:
    code, out, _ = await shepherd_install("--help")
    assert code == 0
    from shepherd.install import build_parser

    options = {o for a in build_parser()._actions for o in a.option_strings if o.startswith("--")}
    for option in options - {"--help"}:
        assert option in out, option
    examples = out[out.index("examples:") :]
    for option in ("--machine", "--state", "--image-url", "--image-server", "--dry-run"):
        assert re.search(rf"{option}\b", examples), option
    # The main command's help points to it.
    result = await trio.run_process(
        [sys.executable, "-m", "shepherd", "--help"], capture_stdout=True, check=False
    )
    assert "python -m shepherd install --help" in result.stdout.decode()
