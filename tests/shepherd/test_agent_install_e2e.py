"""The real agent process installs the node on a loopback fleet machine.

The agent is the uploaded zipapp, run as the initializer runs it (without
SSH, which the takeover tests cover) at ``/root/agent`` of a
`shepherd.localfleet` machine, with its disk ``/root/disks/disk0``. The
heartbeat server is a stand-in of this test (HTTPS, the agent's CA): it
answers with an installation request, as the agent callback server does
while no report of that generation is stored, and records what the agent
sends. The image server (HTTPS, same CA) serves a stand-in node image.
"""

from __future__ import annotations

import http.server
import os
import ssl
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import trio
import trio_asyncio

from shepherd.agent import protocol, wire
from shepherd.agent.disks import LOOPBACK_MODEL
from shepherd.localfleet import DISK, agent_pid, node_pid, open_fleet, wait_until
from shepherd.proto import agent_callback as bp
from shepherd.ssh_key import SSHKey
from tests.shepherd.agent_install import (
    QuietServer,
    encode_response,
    kill_nodes,
    request,
    serve_images,
    stand_in_image,
)
from tests.shepherd.agents import TLSFiles, kill_agent, make_tls, start_agent_process


@dataclass
class HeartbeatServer:
    """Answers heartbeats with ``request`` until a report of its generation
    arrives (then with nothing), like the agent callback server."""

    request: wire.InstallationRequest | None = None
    #: Answers with these bytes instead, while not empty (one per heartbeat).
    malformed: list[bytes] = field(default_factory=list)
    heartbeats: list[bp.HeartbeatRequest] = field(default_factory=list)
    report: bp.OsInstallationReport | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    port: int = 0

    def answer(self, body: bytes) -> bytes:
        heartbeat = bp.HeartbeatRequest.parse(body)
        with self.lock:
            self.heartbeats.append(heartbeat)
            got = heartbeat.installation_report
            request = self.request
            if got is not None and request is not None and got.generation == request.generation:
                self.report = got
                self.request = None  # stored: no longer asked for
            if self.malformed:
                return self.malformed.pop(0)
            return encode_response(self.request)

    def reports(self) -> list[bp.OsInstallationReport]:
        with self.lock:
            return [h.installation_report for h in self.heartbeats if h.installation_report]


@contextmanager
def serve_heartbeats(tls: TLSFiles) -> Iterator[HeartbeatServer]:
    state = HeartbeatServer()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            answer = state.answer(body) if self.path == protocol.HEARTBEAT_PATH else b""
            self.send_response(200)
            self.send_header("Content-Type", "application/proto")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

    httpd = QuietServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(tls.certfile), str(tls.keyfile))
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    state.port = httpd.server_address[1]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


async def _until(predicate: Callable[[], bool]) -> None:
    with trio.fail_after(60):
        await wait_until(predicate)


async def test_the_agent_installs_reports_once_and_never_twice(
    tmp_path: Path,
    aio_loop: trio_asyncio.TrioEventLoop,  # the fleet's asyncssh servers
    shepherd_ssh_key: SSHKey,
) -> None:
    tls = make_tls(tmp_path / "tls")
    target: Path | None = None
    try:
        with serve_images((tls.certfile, tls.keyfile)) as images, serve_heartbeats(tls) as hb:
            async with open_fleet(
                tmp_path / "fleet", count=1, authorized_key=shepherd_ssh_key.authorized_key
            ) as fleet:
                (machine,) = fleet.machines
                assert machine.host == "127.0.0.2"
                disk = machine.root / DISK
                target = machine.root / "root" / "agent"
                digest = images.add(stand_in_image())
                req = request(
                    1,
                    host=f"127.0.0.1:{images.port}",
                    digest=f"sha256:{digest}",
                    node_address=machine.host,
                )
                hb.request = req
                # First, malformed requests: ignored, heartbeats go on.
                hb.malformed = [b"\x0a\x05\x08\x01"] * 3
                endpoint = f"https://127.0.0.1:{hb.port}"
                start_agent_process(target, "m-1", endpoint, interval=0.3, cap=1.0, ca=tls.ca_der)

                await _until(lambda: hb.report is not None)
                key = (disk / "node.key.pub").read_bytes()
                assert hb.report == bp.OsInstallationReport(
                    generation=1, success=bp.OsInstallationReportSuccess(node_public_key=key)
                )
                # The hardware report listed the disk as a loopback folder.
                reported = [h.hardware_report for h in hb.heartbeats if h.hardware_report]
                assert reported and reported[0].report is not None
                loopback = [
                    (d.serial_number, d.device_model) for d in reported[0].report.block_device
                ]
                assert ("disk0", LOOPBACK_MODEL) in loopback
                log = target.with_name("agent.log")
                assert log.read_text().count("ignoring a malformed installation request") == 1

                # No longer asked for: no longer sent.
                sent = len(hb.heartbeats)
                await _until(lambda: len(hb.heartbeats) >= sent + 3)
                assert len(hb.reports()) == 1

                # The node outlives its agent.
                node = node_pid(disk)
                assert node is not None
                kill_agent(target)
                await _until(lambda: agent_pid(target) is None)
                assert node_pid(disk) == node

                # A restarted agent asked for generation 1 again (as if the
                # report had been lost) reports it again, installs nothing.
                downloads = len(images.ranges)
                with hb.lock:
                    hb.report, hb.request = None, req
                start_agent_process(target, "m-1", endpoint, interval=0.3, cap=1.0, ca=tls.ca_der)
                await _until(lambda: hb.report is not None)
                again = hb.reports()[-1]
                assert again.success is not None and again.success.node_public_key == key
                assert len(images.ranges) == downloads
                assert node_pid(disk) == node
            # The machine went away, and its node with it.
            await _until(lambda: node_pid(disk) is None)
    finally:
        if target is not None:
            kill_agent(target)
        kill_nodes(tmp_path)


async def test_an_agent_killed_mid_download_is_not_run_again_and_says_so(
    tmp_path: Path,
    aio_loop: trio_asyncio.TrioEventLoop,
    shepherd_ssh_key: SSHKey,
) -> None:
    tls = make_tls(tmp_path / "tls")
    target: Path | None = None
    try:
        with serve_images((tls.certfile, tls.keyfile)) as images, serve_heartbeats(tls) as hb:
            async with open_fleet(
                tmp_path / "fleet", count=1, authorized_key=shepherd_ssh_key.authorized_key
            ) as fleet:
                (machine,) = fleet.machines
                disk = machine.root / DISK
                target = machine.root / "root" / "agent"
                images.pause = 0.05  # about 1.3 MB/s: the download takes a while
                digest = images.add(stand_in_image(size=8 * 1024 * 1024))
                hb.request = request(1, host=f"127.0.0.1:{images.port}", digest=f"sha256:{digest}")
                endpoint = f"https://127.0.0.1:{hb.port}"
                start_agent_process(target, "m-1", endpoint, interval=0.3, cap=1.0, ca=tls.ca_der)
                await _until(lambda: any(n.endswith(".part") for n in os.listdir(disk)))
                # Heartbeats go on beside the download.
                sent = len(hb.heartbeats)
                await _until(lambda: len(hb.heartbeats) >= sent + 2)
                assert any(n.endswith(".part") for n in os.listdir(disk))  # still downloading
                kill_agent(target)  # SIGKILL, mid-download
                await _until(lambda: agent_pid(target) is None)
                assert hb.report is None
                downloads = len(images.ranges)

                start_agent_process(target, "m-1", endpoint, interval=0.3, cap=1.0, ca=tls.ca_der)
                await _until(lambda: hb.report is not None)
                assert hb.report is not None and hb.report.error is not None
                assert hb.report.error.error.startswith("interrupted: "), hb.report
                assert len(images.ranges) == downloads  # not downloaded again
                assert os.listdir(disk) == []  # the half download removed, nothing started
    finally:
        if target is not None:
            kill_agent(target)
        kill_nodes(tmp_path)
