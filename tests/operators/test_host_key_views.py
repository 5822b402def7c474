"""A machine's SSH host key is shown as the ``SHA256:`` fingerprint that the
real ``ssh-keygen -l`` prints for it, in ``bmdb machine`` and on its page."""

from __future__ import annotations

import base64
import html
import shutil
import subprocess
from pathlib import Path

import httpx
import trio

import bmdb
from bmdb.overview import State
from console.server import serve
from tests.bmdb.test_cli import cli
from tests.operators.populate import populate


def _real_key(root: Path) -> tuple[bytes, str]:
    """A new Ed25519 key's wire format and ssh-keygen's fingerprint of it."""
    keygen = shutil.which("ssh-keygen")
    assert keygen, "ssh-keygen (openssh-client) is needed"
    key = root / "host_key"
    subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    pub = key.with_suffix(".pub")
    wire = base64.b64decode(pub.read_text().split()[1])
    out = subprocess.run(
        [keygen, "-l", "-f", str(pub)], check=True, capture_output=True, text=True
    ).stdout
    return wire, out.split()[1]


async def test_host_key_fingerprint_in_cli_and_page(
    bmdb_conn: bmdb.Connection, bmdb_url: str, nursery: trio.Nursery, tmp_path: Path
) -> None:
    fleet = await populate(bmdb_conn)
    mid = fleet.ids[State.FAILED]
    wire, printed = _real_key(tmp_path)

    async def store(q: bmdb.Queries) -> None:
        await q.set_ssh_host_key(mid, wire)

    await bmdb_conn.transact(store)
    code, out, err = await cli("--url", bmdb_url, "machine", str(mid))
    assert (code, err) == (0, "")
    assert f"ssh host key:            {printed}\n" in out

    [base] = await nursery.start(serve, bmdb_conn, "127.0.0.1:0")
    async with httpx.AsyncClient(base_url=base) as client:
        page = (await client.get(f"/machine/{mid}")).text
    assert f"<td>{html.escape(printed)}</td>" in page
    assert wire.hex() not in page
