"""The first page says where to go next on an empty fleet and on one where
every machine failed: real PostgreSQL, the console's own server, HTTP."""

from __future__ import annotations

import html
import uuid

import httpx
import trio

import bmdb
from bmdb import Backoff, Process, Provider, Queries
from console.guidance import ADD_MACHINES
from console.server import serve


async def _page(conn: bmdb.Connection, nursery: trio.Nursery, path: str = "/") -> str:
    urls: list[str] = await nursery.start(serve, conn, "127.0.0.1:0")
    async with httpx.AsyncClient() as client:
        response = await client.get(urls[0] + path, timeout=30)
    assert response.status_code == 200
    return html.unescape(response.text)


async def _machines(conn: bmdb.Connection, n: int) -> list[uuid.UUID]:
    async def make(q: Queries) -> list[uuid.UUID]:
        ids = []
        for i in range(n):
            mid = await q.new_machine()
            await q.add_provided(mid, Provider.STATIC, f"g-{i}", f"10.0.0.{i}")
            ids.append(mid)
        return ids

    return await conn.transact(make)


async def _fail(conn: bmdb.Connection, ids: list[uuid.UUID], cause: str) -> None:
    async with conn.session("test-guidance", "pytest") as sess:
        for mid in ids:

            async def source(q: Queries, mid: uuid.UUID = mid) -> list[uuid.UUID]:
                return [mid]

            work = await sess.work(Process.SHEPHERD_AGENT_START, source)
            await work.fail(cause, Backoff(initial=3600))


async def test_an_empty_fleet_names_the_command_that_adds_machines(
    bmdb_conn: bmdb.Connection, nursery: trio.Nursery
) -> None:
    text = await _page(bmdb_conn, nursery)
    assert 'id="next-step"' in text and ADD_MACHINES in text


async def test_a_fleet_where_all_failed_names_the_shared_cause_and_links_the_list(
    bmdb_conn: bmdb.Connection, nursery: trio.Nursery
) -> None:
    ids = await _machines(bmdb_conn, 3)
    await _fail(bmdb_conn, ids[:2], "no route to host")
    await _fail(bmdb_conn, ids[2:], "refused our key")
    text = await _page(bmdb_conn, nursery)
    assert "Every machine failed (3)." in text
    assert "2 of the 3 shown failed with: <q>no route to host</q>." in text
    assert '<a href="/machines?state=failed">the failed machines</a>' in text
    # Filtered pages keep to their rows.
    assert 'id="next-step"' not in await _page(bmdb_conn, nursery, "/machines?state=failed")


async def test_a_fleet_with_a_working_machine_gets_no_guidance(
    bmdb_conn: bmdb.Connection, nursery: trio.Nursery
) -> None:
    ids = await _machines(bmdb_conn, 2)
    await _fail(bmdb_conn, ids[:1], "no route to host")
    assert 'id="next-step"' not in await _page(bmdb_conn, nursery)
