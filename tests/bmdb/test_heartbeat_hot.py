"""Heartbeats stay HOT updates: no index covers the columns they write, and
the heartbeat table keeps room on its pages (fill factor below 100).

An index on ``agent_heartbeat_at`` (say, for the recovery source) would make
every heartbeat write an index entry and bloat table and index under the
fleet's churn (bench/growth.py measures it); these tests fail first.
"""

from __future__ import annotations

import datetime

import bmdb
from bmdb import Isolation
from bmdb.model import AgentHeartbeat, Queries
from tests.bmdb.helpers import add_provided_machines

KEY = bytes(range(32))
#: What a heartbeat writes.
WRITTEN = {"agent_heartbeat_at", "agent_request_time_ns"}


async def test_no_index_covers_the_heartbeat_columns(bmdb_conn: bmdb.Connection) -> None:
    async def fn(q: Queries) -> list[tuple[str, list[str], str | None]]:
        rows = await q.execute(
            """SELECT i.indexrelid::regclass::text,
                      array(SELECT a.attname::text FROM pg_attribute a
                            WHERE a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey)),
                      pg_get_expr(i.indexprs, i.indrelid) || ' ' ||
                      coalesce(pg_get_expr(i.indpred, i.indrelid), '')
               FROM pg_index i WHERE i.indrelid = 'machine_agent_heartbeat'::regclass"""
        )
        return [(str(r[0]), list(r[1]), r[2]) for r in rows]

    indexes = await bmdb_conn.transact(fn)
    assert indexes, "the heartbeat table has lost its primary key"
    for name, columns, expressions in indexes:
        assert not WRITTEN & set(columns), f"{name} covers {columns}: heartbeats would not be HOT"
        assert expressions is None or not any(c in expressions for c in WRITTEN), name

    async def options(q: Queries) -> list[str]:
        rows = await q.execute(
            "SELECT coalesce(reloptions, '{}') FROM pg_class"
            " WHERE oid = 'machine_agent_heartbeat'::regclass"
        )
        return list(rows[0][0])

    assert "fillfactor=50" in await bmdb_conn.transact(options)


async def test_repeated_heartbeats_are_hot_updates(bmdb_conn: bmdb.Connection) -> None:
    machines = sorted(await add_provided_machines(bmdb_conn, 50), key=lambda m: m.int)

    async def start(q: Queries) -> None:
        for m in machines:
            await q.set_agent_started(m, datetime.datetime.now(datetime.UTC), KEY)

    await bmdb_conn.transact(start)

    async def beat(t: int) -> tuple[int, int, int]:
        # Each heartbeat group in its own transaction, as the server commits
        # them; each reads its own transaction's counts.
        async def fn(q: Queries) -> tuple[int, int, int]:
            await q.record_agent_heartbeats_pending([AgentHeartbeat(m, KEY, t) for m in machines])
            ((upd, hot, started),) = await q.execute(
                """SELECT h.n_tup_upd, h.n_tup_hot_upd, s.n_tup_upd
                   FROM pg_stat_xact_user_tables h, pg_stat_xact_user_tables s
                   WHERE h.relname = 'machine_agent_heartbeat'
                     AND s.relname = 'machine_agent_started'"""
            )
            return int(upd), int(hot), int(started)

        return await bmdb_conn.transact(fn, isolation=Isolation.READ_COMMITTED)

    assert (await beat(1))[:2] == (0, 0)  # the first heartbeat inserts the rows
    started_updates = 0
    for t in range(2, 12):
        upd, hot, started = await beat(t)
        assert upd >= len(machines) and hot == upd, (t, upd, hot)
        started_updates += started
    # The recovery source's floor (migration 0007) moves only when a
    # heartbeat crosses into the next 5 minutes: at most once in this test.
    assert started_updates <= len(machines)
