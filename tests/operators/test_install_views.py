"""Installation states in the views: ``bmdb machines`` / ``machine``, the web
UI in a real browser, and ``console web``'s metrics, over real PostgreSQL
holding the install requests and reports as the Shepherd and the agent
callback server store them (`populate_installs`)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import httpx
import pytest
import trio
from playwright.async_api import BrowserContext, Page

import bmdb
from bmdb import overview
from bmdb.errors import InvalidArgument
from bmdb.model import node_id
from console.server import serve
from tests.bmdb.test_cli import cli
from tests.operators.browser import Chromium
from tests.operators.populate import (
    HTML_INSTALL_CAUSE,
    IMAGE_DIGEST,
    ROOT_DEVICE,
    Installs,
    populate_installs,
)
from tests.operators.test_metrics import parse, value


@pytest.fixture
async def installs(bmdb_conn: bmdb.Connection) -> Installs:
    return await populate_installs(bmdb_conn)


def _fields(out: str) -> dict[str, str]:
    return {
        k: v.strip() for k, v in (line.split(": ", 1) for line in out.splitlines() if ": " in line)
    }


async def test_cli_lists_each_install_state_with_generation_node_and_cause(
    installs: Installs, bmdb_url: str
) -> None:
    node = node_id(installs.node_public_key)
    code, out, err = await cli("--url", bmdb_url, "machines")
    assert (code, err) == (0, "")
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert rows[str(installs.installing)].split()[1:4] == ["heartbeating", "installing@2", "-"]
    assert rows[str(installs.installed)].split()[1:4] == ["heartbeating", "installed@1", node]
    assert rows[str(installs.failed)].split()[1:4] == ["heartbeating", "install-failed@3", "-"]
    assert rows[str(installs.failed)].endswith(HTML_INSTALL_CAUSE)

    for state, mid in (
        ("installing", installs.installing),
        ("installed", installs.installed),
        ("install-failed", installs.failed),
    ):
        code, out, _ = await cli("--url", bmdb_url, "machines", "--state", state, "--json")
        assert code == 0
        assert [m["machine_id"] for m in json.loads(out)] == [str(mid)], state

    code, out, _ = await cli("--url", bmdb_url, "machine", str(installs.installing))
    fields = _fields(out)
    assert fields["install"] == "installing (generation 2)"
    # The report on generation 1 is not this generation's outcome.
    assert fields["install last report"] == "generation 1"
    assert "install node" not in fields
    code, out, _ = await cli("--url", bmdb_url, "machine", str(installs.failed))
    fields = _fields(out)
    assert fields["install"] == "install-failed (generation 3)"
    assert fields["install cause"] == HTML_INSTALL_CAUSE
    code, out, _ = await cli("--url", bmdb_url, "machine", str(installs.installed), "--json")
    detail = json.loads(out)["installation"]
    assert detail["node_public_key"] == installs.node_public_key.hex()
    assert detail["node_id"] == node


async def _rows(page: Page) -> list[list[str]]:
    cells: list[list[str]] = await page.eval_on_selector_all(
        "main > table tbody tr",
        "rows => rows.map(r => Array.from(r.cells, c => c.innerText))",
    )
    return cells


async def _section(page: Page, title: str) -> dict[str, str]:
    text = await page.inner_text(f"h2:has-text('{title}') + table.fields")
    return dict(line.split("\t", 1) for line in text.splitlines())


async def test_browser_filters_by_install_state_and_follows_machine_to_node(
    installs: Installs, bmdb_conn: bmdb.Connection, nursery: trio.Nursery, chromium: Chromium
) -> None:
    urls: list[str] = await nursery.start(serve, bmdb_conn, "127.0.0.1:0")
    web = urls[0]
    node = node_id(installs.node_public_key)

    async def scenario(context: BrowserContext) -> None:
        page = await context.new_page()
        dialogs: list[str] = []
        page.on("dialog", lambda d: dialogs.append(d.message))
        await page.goto(f"{web}/machines")
        header = await page.inner_text("main > table thead")
        assert header.split("\t")[:4] == ["machine", "state", "install", "node"]
        by_id = {r[0]: r for r in await _rows(page)}
        assert by_id[str(installs.installing)][2:4] == ["installing@2", "-"]
        assert by_id[str(installs.installed)][2:4] == ["installed@1", node]
        assert by_id[str(installs.failed)][2] == "install-failed@3"
        assert by_id[str(installs.failed)][-1] == HTML_INSTALL_CAUSE

        # The filter links count each installation state.
        await page.get_by_role("link", name="install-failed (1)").click()
        await page.wait_for_url("**/machines?state=install-failed")
        [row] = await _rows(page)
        assert row[0] == str(installs.failed)
        await page.get_by_role("link", name=str(installs.failed)).click()
        await page.wait_for_url(f"**/machine/{installs.failed}")
        failed = await _section(page, "OS installation")
        assert failed["state"] == "install-failed@3"
        assert failed["generation"] == "3"
        assert failed["outcome"] == "error"
        assert failed["cause"] == HTML_INSTALL_CAUSE
        assert failed["root device"] == ROOT_DEVICE and failed["image"] == IMAGE_DIGEST
        assert await page.locator("main i").count() == 0  # the cause's HTML is text

        await page.goto(f"{web}/machines?state=installing")
        await page.get_by_role("link", name=str(installs.installing)).click()
        await page.wait_for_url(f"**/machine/{installs.installing}")
        installing = await _section(page, "OS installation")
        assert installing["state"] == "installing@2"
        assert installing["last report"] == "generation 1"
        assert "node" not in installing

        await page.goto(f"{web}/machines?state=installed")
        await page.get_by_role("link", name=str(installs.installed)).click()
        await page.wait_for_url(f"**/machine/{installs.installed}")
        installed = await _section(page, "OS installation")
        assert installed["outcome"] == "success"
        assert installed["node"] == node
        assert installed["node public key"] == installs.node_public_key.hex()
        # The node links to the cluster's page of it (here: the cluster
        # views are off, and that page says how to turn them on).
        await page.get_by_role("link", name=node).click()
        await page.wait_for_url(f"**/cluster/node/{node}")
        assert "--cluster-owner-root DIR" in await page.inner_text("main")
        assert dialogs == []

    await chromium.run(scenario)


async def test_console_web_metrics_count_install_states(installs: Installs, bmdb_url: str) -> None:
    argv = [
        sys.executable, "-m", "console", "--url", bmdb_url, "web", "--listen", "127.0.0.1:0",
        "--metrics-listen", "127.0.0.1:0",
    ]  # fmt: skip
    proc = await trio.lowlevel.open_process(argv, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        text = b""
        with trio.fail_after(60):
            while text.count(b"\n") < 2:
                text += await proc.stdout.receive_some(1)
        metrics_url = text.decode().splitlines()[0].split()[2]
        async with httpx.AsyncClient() as client:
            scrape = await client.get(metrics_url)
        assert scrape.status_code == 200
        samples = parse(scrape.text)
        for state in ("installing", "installed", "install-failed"):
            assert value(samples, "bmdb_fleet_machines_installation", state=state) == 1, state
        assert value(samples, "bmdb_fleet_machines") == 3
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(60):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_machines_of_nodes_names_only_current_successful_installs(
    installs: Installs, bmdb_conn: bmdb.Connection
) -> None:
    stale = b"o" * 32  # reported on generation 1 of a machine now asked for generation 2
    unknown = bytes(32)
    found = await overview.machines_of_nodes(bmdb_conn, [installs.node_public_key, stale, unknown])
    assert found == {installs.node_public_key: (installs.installed,)}
    assert await overview.machines_of_nodes(bmdb_conn, []) == {}
    with pytest.raises(InvalidArgument, match="32 bytes"):
        await overview.machines_of_nodes(bmdb_conn, [b"short"])
    with pytest.raises(InvalidArgument, match="at most"):
        await overview.machines_of_nodes(bmdb_conn, [unknown] * (overview.MAX_NODE_KEYS + 1))
