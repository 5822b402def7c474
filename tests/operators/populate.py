"""A small BMDB fleet with one machine in every operator-facing state."""

from __future__ import annotations

import datetime
import uuid
from dataclasses import dataclass

import bmdb
from bmdb import Backoff, Process, Provider
from bmdb.model import Queries
from bmdb.overview import State

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
