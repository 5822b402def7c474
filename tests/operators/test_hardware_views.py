"""A machine's hardware report, readable in ``bmdb machine`` (and its
``--json``) and on its page: CPUs, memory, disks by the name an
installation's ``--root-device`` takes, NICs by MAC.

The report is the real agent's of this machine (`shepherd.agent.hwreport`,
with a loopback disk beside it), sent by the agent's heartbeat code to the
real callback server, which stores it in the BMDB as it does for every
agent. Reports that do not decode (cut short, not one, too large) and
hostile ones (markup, control characters, huge texts, sixty thousand
NICs) say "unreadable: ..." or show as bounded text: never a 500, a
traceback or markup.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import pytest
import trio
from playwright.async_api import BrowserContext

import bmdb
from bmdb import Queries
from bmdb.overview import MAX_HARDWARE_REPORT
from common import hwreport
from console.server import serve
from shepherd.agent import hwreport as agent_hwreport
from shepherd.agent_server import AgentServerConfig, run_agent_server
from shepherd.agent_server.server import port_of
from shepherd.proto.agent_callback import AgentHardwareReport
from shepherd.proto.hwreport import BlockDevice, Cpu, NetworkInterface, Node
from tests.bmdb.test_cli import cli
from tests.operators.browser import Chromium
from tests.operators.test_hostile_web import STRANGE, _inert, _Parsed
from tests.shepherd.test_agent_server import heartbeater, post, started_machine


async def _real_report(conn: bmdb.Connection, nursery: trio.Nursery, root: Path) -> uuid.UUID:
    """A machine whose agent sent this machine's real report through the real server."""
    (root / "disks" / "disk0").mkdir(parents=True)
    binds = await nursery.start(
        lambda task_status: run_agent_server(
            conn, AgentServerConfig(listen="127.0.0.1:0"), task_status=task_status
        )
    )
    url = f"http://127.0.0.1:{port_of(binds[0])}"
    mid, seed = await started_machine(conn)
    hb = heartbeater(url, str(mid), seed, report=False)
    hb.report = agent_hwreport.collect_hardware_report(str(root))
    assert await post(url, *hb.request()) == (200, "")
    return mid


def _cpu_threads() -> int:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return sum(1 for line in lines if line.startswith("processor"))


async def _stored(conn: bmdb.Connection, mid: uuid.UUID) -> AgentHardwareReport:
    async def read(q: Queries) -> bytes | None:
        return await q.hardware_report(mid)

    raw = await conn.transact(read)
    assert raw is not None
    return AgentHardwareReport.parse(raw)


async def test_a_real_agents_report_in_the_cli_its_json_and_the_page(
    bmdb_conn: bmdb.Connection,
    bmdb_url: str,
    nursery: trio.Nursery,
    tmp_path: Path,
    chromium: Chromium,
) -> None:
    mid = await _real_report(bmdb_conn, nursery, tmp_path / "machine")
    node = (await _stored(bmdb_conn, mid)).report
    assert node is not None
    macs = [n.mac.hex(":") for n in node.network_interface]
    assert macs, "the agent found no NIC on this machine"
    disk0 = next(d for d in node.block_device if d.serial_number == "disk0")

    code, out, err = await cli("--url", bmdb_url, "machine", str(mid))
    assert (code, err) == (0, "")
    fields = [line.split(":", 1) for line in out.split("\n\n")[0].splitlines()]
    shown = [(k, v.strip()) for k, v in fields]
    by_label: dict[str, list[str]] = {}
    for k, v in shown:
        by_label.setdefault(k, []).append(v)
    assert by_label["cpus"][0].endswith(f"threads: {node.cpu[0].model}"), by_label["cpus"]
    assert f"{_cpu_threads()} threads" in by_label["cpus"][0]
    assert by_label["memory"][0].startswith(
        f"{hwreport.size(node.memory_installed_bytes)} installed"
    )
    assert (
        f"disk0: {hwreport.size(disk0.capacity_bytes)}, monotrio loopback folder"
        in (by_label["disk"])
    )
    assert [v.split(": ")[0] for v in by_label["nic"]] == macs
    assert by_label["hardware report"][0].endswith(" bytes")

    code, out, err = await cli("--url", bmdb_url, "machine", "--json", str(mid))
    assert (code, err) == (0, "")
    report = json.loads(out)["hardware_report"]
    assert sum(c["threads"] for c in report["cpus"]) == _cpu_threads()
    [shown_disk0] = [d for d in report["disks"] if d["name"] == "disk0"]
    assert shown_disk0["capacity_bytes"] == disk0.capacity_bytes
    assert [n["mac"] for n in report["nics"]] == macs
    assert report["memory_installed_bytes"] == node.memory_installed_bytes

    [web] = await nursery.start(serve, bmdb_conn, "127.0.0.1:0")

    async def scenario(context: BrowserContext) -> None:
        page = await context.new_page()
        await page.goto(f"{web}/machines")
        await page.get_by_role("link", name=str(mid)).click()
        await page.wait_for_url(f"**/machine/{mid}")
        hardware = await page.inner_text("table#hardware")
        assert f"{_cpu_threads()} threads" in hardware
        assert hwreport.size(node.memory_installed_bytes) in hardware
        disks = await page.locator("table#disks tbody tr").all_inner_texts()
        assert len(disks) == len(node.block_device)
        assert any(row.startswith("disk0\t") for row in disks), disks
        nics = await page.locator("table#nics tbody tr").all_inner_texts()
        assert [row.split("\t")[0] for row in nics] == macs
        # The sections after it are whole.
        assert await page.locator("h2:has-text('OS installation')").count() == 1

    await chromium.run(scenario)


#: Reports stored by something other than a server that checked them.
UNREADABLE = {
    "cut short": bytes(AgentHardwareReport(report=Node(manufacturer="m" * 50)))[:20],
    "not a report": b"GET / HTTP/1.1\r\n\r\n",
    "not UTF-8": b"\x0a\x03\x0a\x01\xff",
    "no report in it": b"\x12\x01w",
    "too large": b"\x12\x02ok" * (MAX_HARDWARE_REPORT // 4 + 1),
}


async def _machine_with_report(conn: bmdb.Connection, raw: bytes) -> uuid.UUID:
    async def make(q: Queries) -> uuid.UUID:
        mid = await q.new_machine()
        await q.set_hardware_report(mid, raw)
        return mid

    return await conn.transact(make)


@pytest.mark.parametrize("case", sorted(UNREADABLE))
async def test_a_report_that_does_not_decode_says_unreadable(
    bmdb_conn: bmdb.Connection, bmdb_url: str, nursery: trio.Nursery, case: str
) -> None:
    raw = UNREADABLE[case]
    mid = await _machine_with_report(bmdb_conn, raw)
    code, out, err = await cli("--url", bmdb_url, "machine", str(mid))
    assert (code, err) == (0, ""), err
    [line] = [line for line in out.splitlines() if line.startswith("hardware report:")]
    assert "unreadable: " in line and f"{len(raw)}" in line, line
    code, out, err = await cli("--url", bmdb_url, "machine", "--json", str(mid))
    assert (code, err) == (0, "")
    shown = json.loads(out)
    assert shown["hardware_report"]["unreadable"] in line
    assert shown["hardware_report_bytes"] == len(raw)

    [web] = await nursery.start(serve, bmdb_conn, "127.0.0.1:0")
    async with httpx.AsyncClient(base_url=web, timeout=60) as client:
        r = await client.get(f"/machine/{mid}")
    assert r.status_code == 200
    _inert(r.text, f"unreadable: {shown['hardware_report']['unreadable']}")


NICS = 60_000


async def test_hostile_texts_and_lists_are_shown_as_bounded_text(
    bmdb_conn: bmdb.Connection, bmdb_url: str, nursery: trio.Nursery, chromium: Chromium
) -> None:
    huge = STRANGE * 1000
    node = Node(
        manufacturer=STRANGE,
        product=huge,
        cpu=[Cpu(model=STRANGE, cores=2, hardware_threads=4)],
        block_device=[BlockDevice(serial_number=STRANGE, device_model=huge, capacity_bytes=-1)],
        # Sixty thousand NICs, of a few bytes each: under the bound on reads.
        network_interface=[NetworkInterface(mac=b"\x01\x02", driver="<b>x</b>")]
        + [NetworkInterface(mac=b"\x01\x02")] * (NICS - 1),
    )
    raw = bytes(AgentHardwareReport(report=node, warning=[STRANGE, huge]))
    assert len(raw) < MAX_HARDWARE_REPORT
    mid = await _machine_with_report(bmdb_conn, raw)
    decoded = hwreport.decode(raw)

    code, out, err = await cli("--url", bmdb_url, "machine", str(mid))
    assert (code, err) == (0, "")
    assert all(line.isprintable() for line in out.splitlines())
    assert "\x1b" not in out and "\u202e" not in out
    assert f"nic:                     ... and {NICS - hwreport.MAX_LISTED} more" in out
    assert len(out) < 200_000

    [web] = await nursery.start(serve, bmdb_conn, "127.0.0.1:0")
    async with httpx.AsyncClient(base_url=web, timeout=60) as client:
        r = await client.get(f"/machine/{mid}")
    assert r.status_code == 200
    _inert(r.text, decoded.machine, decoded.disks[0].name, decoded.cpus[0].model)
    assert "<b>" not in "".join(_Parsed(r.text).tags)
    assert len(r.content) < 500_000

    async def scenario(context: BrowserContext) -> None:
        page = await context.new_page()
        dialogs: list[str] = []
        page.on("dialog", lambda d: dialogs.append(d.message))
        await page.goto(f"{web}/machine/{mid}")
        assert await page.locator("script, img, iframe, textarea").count() == 0
        rows = await page.locator("table#nics tbody tr").count()
        assert rows == hwreport.MAX_LISTED + 1  # and the "... and N more" row
        assert await page.locator("table#disks tbody tr").count() == 1
        assert await page.locator("h2:has-text('History') + table").count() == 1
        assert dialogs == []

    await chromium.run(scenario)
