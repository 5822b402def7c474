"""The agent's installer (`shepherd.agent.installer`, `install`) against a real image server.

In process: an `Installer` beside a temporary agent path with one loopback
disk, an HTTPS image server of the test (its CA given as the TakeoverInit's
would be) serving a stand-in node image (a zipapp that announces a key and
sleeps), and the real node start (a detached python3 process).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from shepherd.agent import generations, installplan, wire
from shepherd.agent.install import Settings
from shepherd.agent.installer import Installer
from shepherd.localfleet import node_pid
from tests.shepherd.agent_install import (
    ImageServer,
    kill_nodes,
    request,
    serve_images,
    stand_in_image,
)
from tests.shepherd.agents import make_tls

FAST = Settings(
    read_timeout=5.0,
    download_deadline=30.0,
    backoff_start=0.05,
    backoff_cap=0.2,
    announce_timeout=30.0,
    python="/usr/bin/python3",
)


@dataclass
class Machine:
    agent: Path
    disk: Path
    ca: bytes
    server: ImageServer

    def installer(self, settings: Settings = FAST, scheme: str = "https") -> Installer:
        return Installer(
            str(self.agent), endpoint_scheme=scheme, ca_certificate=self.ca, settings=settings
        )

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.server.port}"


@pytest.fixture
def machine(tmp_path: Path) -> Iterator[Machine]:
    tls = make_tls(tmp_path / "tls")
    agent = tmp_path / "root" / "agent"
    disk = tmp_path / "root" / "disks" / "disk0"
    disk.mkdir(parents=True)
    try:
        with serve_images((tls.certfile, tls.keyfile)) as server:
            yield Machine(agent, disk, tls.ca_der, server)
    finally:
        kill_nodes(tmp_path)


def run(installer: Installer, req: wire.InstallationRequest) -> wire.InstallationReport | None:
    """Offer ``req`` as a heartbeat answer would, wait for the install, and
    return the report the next heartbeat carries."""
    installer.on_answer(req)
    installer.join(120)
    installer.on_answer(req)  # the server still asks: the report is due
    return installer.pending_report()


def test_install_starts_the_node_detached_and_reports_its_key(machine: Machine) -> None:
    image = stand_in_image()
    digest = machine.server.add(image)
    params = b"\x0a\x04\x0a\x02hi"
    installer = machine.installer()
    report = run(
        installer, request(1, host=machine.host, digest=f"sha256:{digest}", node_parameters=params)
    )
    disk = machine.disk
    key = (disk / "node.key.pub").read_bytes()
    assert report == wire.InstallationReport(1, node_public_key=key)
    assert len(key) == 32
    assert (disk / "image.pyz").read_bytes() == image
    assert (disk / "node-parameters.pb").read_bytes() == params
    assert stat.S_IMODE((disk / "metropolis").stat().st_mode) == 0o700
    pid = node_pid(disk)
    assert pid is not None and int((disk / "node.pid").read_text()) == pid
    assert os.getsid(pid) == pid  # its own session: the agent's signals do not reach it
    argv = (disk / "metropolis" / "argv.txt").read_text().split("\n")
    assert argv == [
        "node", "register",
        "--parameters", str(disk / "node-parameters.pb"),
        "--root", str(disk / "metropolis"),
        "--address", "127.0.0.2",
        "--insecure-seal",
        "--announce-key", str(disk / "node.key.pub"),
    ]  # fmt: skip
    assert "stand-in node: starting" in (disk / "node.log").read_text()
    assert json.loads((disk / "install.json").read_text()) == {
        "generation": 1, "status": "done", "node_public_key": key.hex()
    }  # fmt: skip
    assert not [n for n in os.listdir(disk) if n.endswith(".part") or n.endswith(".tmp")]
    # Sent while the server asks for generation 1, then no more.
    installer.on_answer(None)
    assert installer.pending_report() is None


def test_wrong_digest_fails_with_the_cause_and_leaves_nothing(machine: Machine) -> None:
    wrong = hashlib.sha256(b"something else").hexdigest()
    machine.server.add(stand_in_image(), name=wrong)
    report = run(machine.installer(), request(1, host=machine.host, digest=f"sha256:{wrong}"))
    assert report is not None and report.error is not None
    assert "image digest mismatch" in report.error and wrong in report.error
    assert os.listdir(machine.disk) == []


def test_server_down_is_retried_with_backoff_then_given_up(machine: Machine) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    settings = Settings(
        read_timeout=1.0, download_deadline=1.5, backoff_start=0.05, backoff_cap=0.2
    )
    report = run(machine.installer(settings), request(1, host=dead, digest="sha256:" + "0" * 64))
    assert report is not None and report.error is not None
    attempts = int(report.error.split("gave up after ")[1].split()[0])
    assert attempts >= 2, report.error
    assert "Connection refused" in report.error
    assert os.listdir(machine.disk) == []


def test_a_cut_connection_resumes_with_a_range_request(machine: Machine) -> None:
    image = stand_in_image(size=3 * 1024 * 1024)
    digest = machine.server.add(image)
    machine.server.cut_after, machine.server.cuts = 1024 * 1024, 2
    report = run(machine.installer(), request(1, host=machine.host, digest=f"sha256:{digest}"))
    assert report is not None and report.node_public_key is not None, report
    assert (machine.disk / "image.pyz").read_bytes() == image
    ranges = machine.server.ranges
    assert ranges[0] is None and len(ranges) == 3
    assert [int(r.removeprefix("bytes=").rstrip("-")) for r in ranges[1:] if r] == [
        1024 * 1024,
        2 * 1024 * 1024,
    ]


def test_a_generation_runs_once_across_restarts_and_reports_its_outcome(
    machine: Machine,
) -> None:
    digest = machine.server.add(stand_in_image())
    req = request(5, host=machine.host, digest=f"sha256:{digest}")
    first = run(machine.installer(), req)
    assert first is not None and first.node_public_key is not None
    served = len(machine.server.ranges)
    pid = node_pid(machine.disk)
    # The same agent, and a restarted one, see generation 5 again.
    assert run(machine.installer(), req) == first
    again = machine.installer()
    assert again.pending_report() is None  # not before the server asks
    assert run(again, req) == first
    assert len(machine.server.ranges) == served  # nothing downloaded again
    assert node_pid(machine.disk) == pid  # nor started again
    # An older generation is not run either.
    assert run(again, request(4, host=machine.host, digest=f"sha256:{digest}")) is None


def test_a_new_generation_after_a_failure_installs_again(machine: Machine) -> None:
    failing = machine.server.add(stand_in_image(b"FAIL"))
    installer = machine.installer()
    first = run(installer, request(1, host=machine.host, digest=f"sha256:{failing}"))
    assert first is not None and first.error is not None
    assert "the node exited before announcing its key" in first.error
    # The node's last lines, escaped (the escape sequence is not sent raw).
    assert "no ticket" in first.error and "\\x1b[31m" in first.error and "\x1b" not in first.error
    good = machine.server.add(stand_in_image(b"ok"))
    second = run(installer, request(2, host=machine.host, digest=f"sha256:{good}"))
    assert second is not None and second.node_public_key is not None, second
    assert (machine.disk / "node.key.pub").read_bytes() == second.node_public_key
    assert json.loads((machine.disk / "install.json").read_text())["generation"] == 2


def test_a_disk_whose_node_still_runs_is_not_installed_over(machine: Machine) -> None:
    digest = machine.server.add(stand_in_image())
    installer = machine.installer()
    first = run(installer, request(1, host=machine.host, digest=f"sha256:{digest}"))
    assert first is not None and first.node_public_key is not None
    second = run(installer, request(2, host=machine.host, digest=f"sha256:{digest}"))
    assert second is not None and second.error is not None
    assert "still runs from" in second.error
    assert (machine.disk / "node.key.pub").read_bytes() == first.node_public_key


def _block_device() -> str:
    """The disk that backs / (always refused): never a disk a test could write."""
    name = os.path.basename(
        os.path.realpath(
            f"/sys/dev/block/{os.major(os.stat('/').st_dev)}:{os.minor(os.stat('/').st_dev)}"
        )
    )
    if os.path.exists(f"/sys/class/block/{name}/partition"):
        name = os.path.basename(os.path.dirname(os.path.realpath(f"/sys/class/block/{name}")))
    if not os.path.exists(f"/sys/block/{name}"):
        pytest.skip(f"/ is not on a disk of /sys/block ({name})")
    return name


HOSTILE: dict[str, tuple[dict[str, object], str]] = {
    "huge parameters": (
        {"node_parameters": b"x" * (installplan.MAX_NODE_PARAMETERS + 1)},
        "node_parameters of 1048577 bytes, over the bound",
    ),
    "no parameters": ({"node_parameters": None}, "no node_parameters"),
    "digest not sha256": ({"digest": "md5:" + "0" * 32}, "is not sha256:<64 lowercase hex>"),
    "digest upper case": ({"digest": "sha256:" + "A" * 64}, "is not sha256:<64 lowercase hex>"),
    "digest short": ({"digest": "sha256:abc"}, "is not sha256:<64 lowercase hex>"),
    "root outside": ({"root_device": "../../etc"}, "not one of this machine's loopback disks"),
    "root absolute": ({"root_device": "/etc"}, "not one of this machine's loopback disks"),
    "root with slash": ({"root_device": "disk0/x"}, "not one of this machine's loopback disks"),
    "root unknown": ({"root_device": "disk7"}, "loopback disks (disk0)"),
    "address with a space": ({"node_address": "a b"}, "not an IP address or host name"),
    "address empty": ({"node_address": ""}, "not an IP address or host name"),
    "address with a command": ({"node_address": "1.2.3.4;reboot"}, "not an IP address"),
    "address bad ipv4": ({"node_address": "1.2.3.999"}, "not an IP address"),
    "scheme ftp": ({"scheme": "ftp"}, "neither https nor http"),
    "plain http beside https": ({"scheme": "http"}, "plain http image is refused"),
    "host with a path": ({"host": "evil.example/x"}, "is not HOST[:PORT]"),
    "host with a user": ({"host": "user@evil.example"}, "is not HOST[:PORT]"),
    "host port out of range": ({"host": "127.0.0.1:70000"}, "port out of range"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_requests_are_refused_with_a_cause_and_nothing_written(
    machine: Machine, case: str
) -> None:
    changes, cause = HOSTILE[case]
    digest = machine.server.add(stand_in_image())
    fields: dict[str, object] = {"host": machine.host, "digest": f"sha256:{digest}", **changes}
    report = run(machine.installer(), request(1, **fields))  # type: ignore[arg-type]
    assert report is not None and report.error is not None
    assert cause in report.error, report.error
    assert os.listdir(machine.disk) == []
    assert machine.server.ranges == []  # not even downloaded


def test_a_real_block_device_goes_to_the_device_checks(machine: Machine) -> None:
    """A kernel name in /sys/block is no loopback disk: `blockdev.check_device`
    judges it (tests/shepherd/test_agent_blockdev.py has each refusal), and
    nothing is downloaded when it refuses."""
    digest = machine.server.add(stand_in_image())
    name = _block_device()
    req = request(1, host=machine.host, digest=f"sha256:{digest}", root_device=name)
    report = run(machine.installer(), req)
    assert report is not None and report.error is not None
    assert report.error.startswith(f"root device /dev/{name} "), report.error
    assert machine.server.ranges == []


def test_a_request_without_metropolis_is_refused(machine: Machine) -> None:
    report = run(machine.installer(), wire.InstallationRequest(1))
    assert report == wire.InstallationReport(
        1, error="the request holds no Metropolis installation"
    )


def test_an_install_interrupted_before_the_node_started_reports_so(machine: Machine) -> None:
    state = Path(f"{machine.agent}.install.json")
    state.write_text(json.dumps({"generation": 3, "status": "started"}))
    stale = machine.disk / ".image-abc.part"
    stale.write_bytes(b"half")
    digest = machine.server.add(stand_in_image())
    report = run(machine.installer(), request(3, host=machine.host, digest=f"sha256:{digest}"))
    assert report is not None and report.error is not None
    assert report.error.startswith("interrupted: ")
    assert machine.server.ranges == []
    assert json.loads(state.read_text())["status"] == "done"


def test_an_agent_restarted_after_the_node_started_reports_its_key(machine: Machine) -> None:
    state = Path(f"{machine.agent}.install.json")
    state.write_text(
        json.dumps({"generation": 3, "status": "node-started", "disk": str(machine.disk)})
    )
    key = os.urandom(32)
    (machine.disk / "node.key.pub").write_bytes(key)
    digest = machine.server.add(stand_in_image())
    report = run(machine.installer(), request(3, host=machine.host, digest=f"sha256:{digest}"))
    assert report == wire.InstallationReport(3, node_public_key=key)
    assert machine.server.ranges == []


def test_an_unreadable_state_file_refuses_every_request(machine: Machine) -> None:
    Path(f"{machine.agent}.install.json").write_text("{not json")
    digest = machine.server.add(stand_in_image())
    report = run(machine.installer(), request(3, host=machine.host, digest=f"sha256:{digest}"))
    assert report is not None and report.error is not None
    assert "is unreadable" in report.error
    assert machine.server.ranges == [] and os.listdir(machine.disk) == []


def test_a_server_the_ca_did_not_sign_is_refused(machine: Machine, tmp_path: Path) -> None:
    digest = machine.server.add(stand_in_image())
    other = make_tls(tmp_path / "other").ca_der
    installer = Installer(
        str(machine.agent),
        endpoint_scheme="https",
        ca_certificate=other,
        settings=FAST,
    )
    report = run(installer, request(1, host=machine.host, digest=f"sha256:{digest}"))
    assert report is not None and report.error is not None
    assert "is not trusted" in report.error and "CERTIFICATE_VERIFY_FAILED" in report.error
    assert len(machine.server.ranges) == 0  # refused in the handshake, and not retried
    assert os.listdir(machine.disk) == []


def test_an_image_over_the_size_bound_is_refused(machine: Machine) -> None:
    image = stand_in_image(size=200_000)
    digest = machine.server.add(image)
    settings = Settings(max_image_bytes=100_000, backoff_start=0.05, backoff_cap=0.1)
    req = request(1, host=machine.host, digest=f"sha256:{digest}")
    report = run(machine.installer(settings), req)
    assert report is not None and report.error is not None
    assert f"image of {len(image)} bytes, over the bound of 100000" in report.error
    assert os.listdir(machine.disk) == []


def test_a_generation_below_one_is_not_run(machine: Machine) -> None:
    digest = machine.server.add(stand_in_image())
    installer = machine.installer()
    for generation in (0, -3):
        req = request(generation, host=machine.host, digest=f"sha256:{digest}")
        assert run(installer, req) is None
    assert machine.server.ranges == [] and os.listdir(machine.disk) == []
    assert not Path(f"{machine.agent}.install.json").exists()


def test_refused_generations_are_logged_once_and_remembered_within_a_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A server that asks for one refused generation after another (each
    older than the one begun) grows the installer's memory by nothing past
    a bound; one asked again at once is logged once."""
    agent = tmp_path / "agent"
    Path(f"{agent}.install.json").write_text(json.dumps({"generation": 10**9, "status": "done"}))
    installer = Installer(str(agent), endpoint_scheme="https", ca_certificate=b"", settings=FAST)
    digest = "sha256:" + "a" * 64

    def ask(generation: int) -> None:
        installer.on_answer(request(generation, host="127.0.0.1:9", digest=digest))

    for _ in range(3):  # heartbeats repeat the request: one line
        ask(5)
    assert capsys.readouterr().err.count("ignoring request of generation 5:") == 1
    for generation in range(1, 20 * generations.TOLD_MAX):
        ask(generation)
    assert len(installer._told) <= generations.TOLD_MAX  # before the bound: one entry each
    # The last ones are remembered, the first forgotten: logged again if asked again.
    capsys.readouterr()
    ask(20 * generations.TOLD_MAX - 1)
    ask(1)
    assert "generation 1:" in capsys.readouterr().err
    assert installer.generation == 10**9  # nothing begun


def test_the_upgrader_remembers_a_bounded_number_of_refusals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As the installer does (above): one line per refused generation, and a
    server that refuses generation after generation cannot grow the memory."""
    from shepherd.agent import upgrade, wire

    upgrader = upgrade.Upgrader(
        str(tmp_path / "agent"), endpoint_scheme="https", ca_certificate=b""
    )
    for _ in range(3):
        upgrader.on_answer(wire.UpgradeRequest(0))
    assert capsys.readouterr().err.count("ignoring upgrade of generation 0:") == 1
    for generation in range(-20 * generations.TOLD_MAX, 0):
        upgrader.on_answer(wire.UpgradeRequest(generation))
    assert len(upgrader._told) <= generations.TOLD_MAX
