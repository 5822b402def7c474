"""`common.hwreport` reads a stored hardware report as the generated classes
and the agent callback server do.

Against betterproto2's classes (``shepherd.proto``) and the server's check
(`common.protobuf.parse_checked`): every report they write decodes to their
values (texts made printable and bounded); any bytes at all decode exactly
when ``parse_checked`` accepts them, and otherwise raise ``ValueError`` (what
the views show as "unreadable"), nothing else. And the real agent's report of
this machine, as the real server takes it, says what /proc and /sys say.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common import hwreport
from common.protobuf import parse_checked
from common.protowire import wire_fields
from common.text import printable
from shepherd.agent import hwreport as agent_hwreport
from shepherd.agent import wire
from shepherd.agent_server.authenticate import parse_request
from shepherd.proto.agent_callback import AgentHardwareReport
from shepherd.proto.hwreport import (
    BlockDevice,
    BlockDeviceProtocol,
    Cpu,
    CpuX8664,
    EfiSupport,
    NetworkInterface,
    Node,
)

INT64 = st.integers(-(2**63), 2**63 - 1)
INT32 = st.integers(-(2**31), 2**31 - 1)
FLOAT32 = st.floats(width=32, allow_nan=False)
TEXT = st.text(max_size=300)

cpus = st.builds(
    Cpu,
    x86_64=st.none() | st.builds(CpuX8664, family=INT32, model=INT32, stepping=INT32),
    hardware_threads=INT32,
    cores=INT32,
    vendor=TEXT,
    model=TEXT,
)
disks = st.builds(
    BlockDevice,
    vendor=TEXT,
    device_model=TEXT,
    serial_number=TEXT,
    wwn=st.binary(max_size=20),
    rotational=st.booleans(),
    capacity_bytes=INT64,
    logical_block_size_bytes=INT32,
    physical_block_size_bytes=INT32,
    protocol=st.sampled_from(BlockDeviceProtocol),
    critical_warning=st.booleans(),
    media_errors=st.none() | INT64,
    available_spare_ratio=st.none() | FLOAT32,
    usage_ratio=st.none() | FLOAT32,
)
nics = st.builds(
    NetworkInterface,
    mac=st.binary(max_size=40),
    driver=TEXT,
    supported_speed_bytes=st.lists(INT64, max_size=4),
    link_up=st.booleans(),
    current_speed_bytes=INT64,
)
nodes = st.builds(
    Node,
    manufacturer=TEXT,
    product=TEXT,
    serial_number=TEXT,
    efi_support=st.sampled_from(EfiSupport),
    memory_installed_bytes=INT64,
    memory_usable_ratio=FLOAT32,
    cpu=st.lists(cpus, max_size=4),
    block_device=st.lists(disks, max_size=4),
    network_interface=st.lists(nics, max_size=4),
)
reports = st.builds(AgentHardwareReport, report=nodes, warning=st.lists(TEXT, max_size=3))


def _text(value: str) -> str:
    return printable(value, hwreport.MAX_TEXT)


def _mac(mac: bytes) -> str:
    if not mac:
        return "-"
    return mac.hex(":") if len(mac) <= 32 else f"{mac[:32].hex(':')}... ({len(mac)} bytes)"


@settings(max_examples=300, deadline=None)
@given(report=reports)
def test_every_report_the_generated_classes_write_decodes_to_their_values(
    report: AgentHardwareReport,
) -> None:
    got = hwreport.decode(bytes(report))
    node = report.report
    assert node is not None
    assert (got.manufacturer, got.product, got.serial_number) == tuple(
        _text(t) for t in (node.manufacturer, node.product, node.serial_number)
    )
    assert got.efi == node.efi_support.name.removeprefix("EFI_SUPPORT_").lower()
    assert got.memory_installed_bytes == node.memory_installed_bytes
    ratio = struct.unpack("<f", struct.pack("<f", node.memory_usable_ratio))[0]
    assert got.memory_usable_ratio == ratio
    assert [(c.vendor, c.model, c.cores, c.threads) for c in got.cpus] == [
        (_text(c.vendor), _text(c.model), c.cores, c.hardware_threads) for c in node.cpu
    ]
    protocols = {0: "", 1: "SCSI", 2: "ATA", 3: "NVMe", 4: "MMC"}
    assert [(d.name, d.capacity_bytes, d.vendor, d.model, d.rotational, d.protocol)
            for d in got.disks] == [
        (_text(d.serial_number), d.capacity_bytes, _text(d.vendor), _text(d.device_model),
         d.rotational, protocols[d.protocol.value])
        for d in node.block_device
    ]  # fmt: skip
    assert [(n.mac, n.driver, n.link_up, n.speed_bytes) for n in got.nics] == [
        (
            _mac(n.mac),
            _text(n.driver),
            n.link_up,
            n.current_speed_bytes,
        )
        for n in node.network_interface
    ]
    assert list(got.warnings) == [printable(w, 2 * hwreport.MAX_TEXT) for w in report.warning]
    # Every line is printable and bounded, whatever the texts were.
    for label, text in got.lines():
        assert text.isprintable() and len(text) < 4 * hwreport.MAX_TEXT, (label, text)


def _mutations(data: bytes) -> st.SearchStrategy[bytes]:
    """``data`` cut, with a byte changed, or with bytes inserted."""
    if not data:
        return st.binary(max_size=200)
    index = st.integers(0, len(data) - 1)
    return st.one_of(
        index.map(lambda i: data[:i]),
        st.tuples(index, st.integers(0, 255)).map(
            lambda t: data[: t[0]] + bytes([t[1]]) + data[t[0] + 1 :]
        ),
        st.tuples(index, st.binary(min_size=1, max_size=8)).map(
            lambda t: data[: t[0]] + t[1] + data[t[0] :]
        ),
        st.binary(max_size=200),
    )


@settings(max_examples=600, deadline=None)
@given(data=reports.map(bytes).flatmap(_mutations))
def test_any_bytes_decode_exactly_when_the_server_would_take_them(data: bytes) -> None:
    try:
        parse_checked(AgentHardwareReport, data)
        checked = None
    except ValueError as exc:
        checked = exc
    try:
        report = hwreport.decode(data)
    except ValueError as exc:
        assert checked is not None or "without a report" in str(exc), (data, exc)
        return
    assert checked is None, (data, checked)
    assert report.lines()  # and they render


def test_bytes_that_are_no_report_say_why() -> None:
    node = bytes(Node(manufacturer="m"))
    for data, why in (
        (b"", "without a report"),
        (b"\x0a\x05" + node[:2], "past end of message"),
        (b"\x0a\x02\x42\x00", "memory_installed_bytes: wire type 2, not the declared"),
        (b"\x0a\x03\x0a\x01\xff", "manufacturer: not UTF-8"),
        (b"\x0a\x00\x0a\x00", "report: set twice"),
        (b"\x0b", "wire type 3"),
        (b"\x0a\x02\x40\xff", "truncated varint"),  # memory's varint
        (b"hello world", "wire type"),
    ):
        with pytest.raises(ValueError, match=why):
            hwreport.decode(data)


def test_huge_texts_and_lists_are_bounded() -> None:
    strange = "<script>\x1b[2J\u202e" * 10_000
    node = Node(
        manufacturer=strange,
        cpu=[Cpu(model=strange, cores=1, hardware_threads=2)] * (hwreport.MAX_LISTED + 5),
        block_device=[BlockDevice(serial_number="d", capacity_bytes=1)] * 1000,
        network_interface=[NetworkInterface(mac=b"\xaa" * 1000, driver=strange)],
    )
    got = hwreport.decode(bytes(AgentHardwareReport(report=node, warning=[strange] * 300)))
    assert len(got.cpus) == len(got.disks) == len(got.warnings) == hwreport.MAX_LISTED
    assert (got.more_cpus, got.more_disks, got.more_nics, got.more_warnings) == (5, 744, 0, 44)
    assert got.cpu_summary.startswith(f"{hwreport.MAX_LISTED + 5} sockets, 256 cores")
    assert "\x1b" not in got.manufacturer and "\\x1b" in got.manufacturer
    assert len(got.manufacturer) < hwreport.MAX_TEXT + 40
    assert got.nics[0].mac.endswith("... (1000 bytes)") and len(got.nics[0].mac) < 200
    lines = got.lines()
    assert ("disk", "... and 744 more") in lines
    assert sum(len(t) for _, t in lines) < 400_000


def test_sizes_and_speeds_read_as_operators_count() -> None:
    assert hwreport.size(512) == "512 B"
    assert hwreport.size(480_103_981_056) == "447.1 GiB"
    assert hwreport.size(-1) == "-1 B"
    disk = hwreport.Disk("S3Z", 10**12, "ATA", "SAMSUNG", False, "ATA")
    assert disk.size == "931.3 GiB" and disk.description == "ATA SAMSUNG, ATA"
    nic = hwreport.NIC("aa:bb:cc:dd:ee:ff", "ixgbe", True, 1_250_000_000)
    assert nic.description == "driver ixgbe, link up, 10 Gbit/s"


def _real_report(agent_dir: Path) -> bytes:
    """The real agent's report of this machine, as the real server stores it."""
    node, warnings = agent_hwreport.collect_hardware_report(str(agent_dir))
    body = wire.encode_heartbeat_request("m", node, warnings, None)
    _, stored = parse_request(body)
    assert stored is not None
    return stored


def test_the_real_agents_report_of_this_machine(tmp_path: Path) -> None:
    (tmp_path / "disks" / "disk0").mkdir(parents=True)
    got = hwreport.decode(_real_report(tmp_path))
    cpuinfo = Path("/proc/cpuinfo").read_text()
    threads = sum(1 for line in cpuinfo.splitlines() if line.startswith("processor"))
    assert sum(c.threads for c in got.cpus) == threads
    model = next(line for line in cpuinfo.splitlines() if line.startswith("model name"))
    assert got.cpus[0].model == model.split(":", 1)[1].strip()
    meminfo = Path("/proc/meminfo").read_text().split()
    assert got.memory_installed_bytes >= int(meminfo[meminfo.index("MemTotal:") + 1]) * 1024
    # The loopback disk, by the name an installation's --root-device takes.
    assert "disk0" in [d.name for d in got.disks]
    macs = {Path(p, "address").read_text().strip() for p in Path("/sys/class/net").iterdir()}
    assert got.nics and {n.mac for n in got.nics} <= macs
    assert dict(got.lines())["cpus"].startswith(f"{len(got.cpus)} socket")


def test_wire_fields_reads_what_it_is_given() -> None:
    assert wire_fields(b"\x08\x96\x01\x12\x02hi\x1d\x00\x00\x80\x3f") == [
        (1, 0, 150),
        (2, 2, b"hi"),
        (3, 5, b"\x00\x00\x80\x3f"),
    ]
    for bad in (b"\x08", b"\x12\x05hi", b"\x1d\x00", b"\x03", b"\x00\x00"):
        with pytest.raises(ValueError):
            wire_fields(bad)
