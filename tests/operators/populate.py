"""A small BMDB fleet with one machine in every operator-facing state."""

from __future__ import annotations

import datetime
import uuid
from dataclasses import dataclass

import bmdb
from bmdb import Backoff, Process, Provider
from bmdb.model import Queries
from bmdb.overview import State
from metropolis import pki
from shepherd.proto.gen.cloud.bmaas.server import api

#: A failure cause that is also HTML, with a line break: must show as text.
HTML_CAUSE = "<script>alert('x')</script><b>bold</b> & more\nsecond line"
#: A provider id that is HTML.
HTML_PROVIDER_ID = "<img src=x onerror=alert(1)>"


@dataclass
class Fleet:
    """Machine ids by the state each was put in."""

    ids: dict[State, uuid.UUID]
    #: A second failed machine, whose cause and provider id are HTML.
    html_machine: uuid.UUID


async def populate(conn: bmdb.Connection) -> Fleet:
    """One machine per state, plus a failed one with HTML in its texts.

    The failed machines failed agent start once (backoff 1 hour), so their
    history is Started, Failed.
    """
    now = datetime.datetime.now(datetime.UTC)
    hour_ago = now - datetime.timedelta(hours=1)

    async def make(q: Queries) -> dict[str, uuid.UUID]:
        ids: dict[str, uuid.UUID] = {}
        for n, name in enumerate(
            ["failed", "needs", "heartbeating", "silent", "started", "html", "unprovided"]
        ):
            mid = await q.new_machine()
            ids[name] = mid
            if name != "unprovided":
                pid = HTML_PROVIDER_ID if name == "html" else f"m-{name}"
                await q.add_provided(mid, Provider.STATIC, pid, f"10.0.0.{n}")
        for name in ("heartbeating", "started"):
            await q.set_agent_started(ids[name], now, b"k" * 32)
        await q.set_agent_started(ids["silent"], hour_ago, b"k" * 32)
        await q.set_agent_heartbeat(ids["heartbeating"], now)
        return ids

    ids = await conn.transact(make)
    async with conn.session("test-populate", "pytest") as sess:
        for name, cause in (("failed", "no route to host"), ("html", HTML_CAUSE)):
            mid = ids[name]

            async def source(q: Queries, mid: uuid.UUID = mid) -> list[uuid.UUID]:
                return [mid]

            work = await sess.work(Process.SHEPHERD_AGENT_START, source)
            await work.fail(cause, Backoff(initial=3600))
    return Fleet(
        ids={
            State.FAILED: ids["failed"],
            State.NEEDS_AGENT_START: ids["needs"],
            State.HEARTBEATING: ids["heartbeating"],
            State.SILENT: ids["silent"],
            State.STARTED: ids["started"],
            State.UNPROVIDED: ids["unprovided"],
        },
        html_machine=ids["html"],
    )


#: An install failure's cause that is also HTML, as an agent might send it.
HTML_INSTALL_CAUSE = "<i>digest</i> sha256:00 != sha256:ff & nothing written"
#: Where the installs of `populate_installs` went.
ROOT_DEVICE = "disk0"
IMAGE_DIGEST = "sha256:" + "ab" * 32


@dataclass
class Installs:
    """Machines of `populate_installs`, by installation state."""

    #: Asked for generation 2; its report is on generation 1 (a reinstall pending).
    installing: uuid.UUID
    #: Installed at generation 1 with the node `node_public_key`.
    installed: uuid.UUID
    #: Failed at generation 3 with `HTML_INSTALL_CAUSE`.
    failed: uuid.UUID
    node_public_key: bytes


async def _install(
    q: Queries,
    mid: uuid.UUID,
    generation: int,
    report: tuple[int, bytes | None, str | None] | None,
) -> None:
    """Ask ``mid`` for ``generation`` (the request and report bytes as the
    Shepherd and the agent send them); then store ``report`` (generation,
    node key on success, cause on failure) as the agent callback server does."""
    request = api.OsInstallationRequest(
        generation=generation,
        metropolis=api.MetropolisInstallationRequest(
            root_device=ROOT_DEVICE, node_address="10.1.0.1"
        ),
    )
    if report is not None:
        # A report is stored only on the generation requested at the time.
        on, key, cause = report
        assert await q.set_os_installation_request(
            mid,
            on,
            bytes(request),
            root_device=ROOT_DEVICE,
            image_digest=IMAGE_DIGEST,
            node_address="10.1.0.1",
        )
        raw = api.OsInstallationReport(generation=on)
        if key is not None:
            raw.success = api.OsInstallationReportSuccess(node_public_key=key)
        else:
            raw.error = api.OsInstallationReportError(error=cause or "")
        assert await q.record_os_installation_report(
            mid, on, bytes(raw), key is not None, cause, key
        )
    if report is None or report[0] != generation:
        assert await q.set_os_installation_request(
            mid,
            generation,
            bytes(request),
            root_device=ROOT_DEVICE,
            image_digest=IMAGE_DIGEST,
            node_address="10.1.0.1",
        )


async def populate_installs(
    conn: bmdb.Connection, node_public_key: bytes | None = None
) -> Installs:
    """Three heartbeating machines, one per installation state. The
    installed one reports ``node_public_key`` (a fresh Ed25519 key's if None)."""
    key = node_public_key or pki.public_key_bytes(pki.generate_key().public_key())
    now = datetime.datetime.now(datetime.UTC)

    async def make(q: Queries) -> Installs:
        ids = []
        for n in range(3):
            mid = await q.new_machine()
            await q.add_provided(mid, Provider.STATIC, f"inst-{n}", f"10.1.0.{n}")
            await q.set_agent_started(mid, now, b"a" * 32)
            await q.set_agent_heartbeat(mid, now)
            ids.append(mid)
        installing, installed, failed = ids
        await _install(q, installing, 2, (1, b"o" * 32, None))
        await _install(q, installed, 1, (1, key, None))
        await _install(q, failed, 3, (3, None, HTML_INSTALL_CAUSE))
        return Installs(installing, installed, failed, key)

    return await conn.transact(make)
