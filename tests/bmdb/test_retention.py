"""Retention (bmdb.retention, ``python -m bmdb prune``): the right rows go,
the rest stay, workers are not blocked, bad flags are clear errors."""

from __future__ import annotations

import datetime
import uuid

import psycopg
import pytest
import trio

import bmdb
from bmdb import Process, actions, retention
from bmdb.errors import InvalidArgument
from bmdb.model import Queries
from tests.bmdb.helpers import add_provided_machines
from tests.bmdb.test_cli import cli

DAY = datetime.timedelta(days=1)

#: Rows per machine (and for no machine, in the audit log): (age in days,
#: how many), written oldest first.
_SHAPES = [
    [(10.0, 5)],  # only old rows: its newest KEEP stay
    [(10.0, 2)],  # fewer old rows than KEEP: all stay
    [(10.0, 4), (0.01, 3)],  # old and recent: the recent are its newest
    [(10.0, 3), (0.5, 1), (9.0, 2)],  # a row out of time order among its own
]
KEEP = 3


async def fill_old_rows(
    conn: bmdb.Connection,
) -> dict[str, list[tuple[int, uuid.UUID | None, float]]]:
    """Write the `_SHAPES` rows into both tables, interleaving machines so
    that one machine's rows are spread over the ids; return, per table,
    every row as (id, machine, age in days)."""
    machines: list[uuid.UUID | None] = list(await add_provided_machines(conn, len(_SHAPES)))

    async def fn(q: Queries) -> dict[str, list[tuple[int, uuid.UUID | None, float]]]:
        written: dict[str, list[tuple[int, uuid.UUID | None, float]]] = {}
        for table, owners in (("work_history", machines), ("audit_log", [*machines[:-1], None])):
            rows = []
            queue = [[age for age, n in shape for _ in range(n)] for shape in _SHAPES]
            while any(queue):
                for machine, ages in zip(owners, queue, strict=True):
                    if not ages:
                        continue
                    age = ages.pop(0)
                    at = datetime.datetime.now(datetime.UTC) - age * DAY
                    if table == "work_history":
                        sql = """INSERT INTO work_history (machine_id, process, event, at)
                                 VALUES (%s, 'UnitTest1', 'Finished', %s) RETURNING id"""
                    else:
                        sql = """INSERT INTO audit_log (machine_id, at, operator, action,
                                                        reason, detail)
                                 VALUES (%s, %s, 'test', 'hold', 'test', 'test') RETURNING id"""
                    [(row_id,)] = await q.execute(sql, (machine, at))
                    rows.append((row_id, machine, age))
            written[table] = rows
        return written

    return await conn.transact(fn)


def expected_kept(rows: list[tuple[int, uuid.UUID | None, float]], keep: int) -> set[int]:
    """What the policy keeps: rows under a day old, and each machine's
    (the machine-less rows' together) newest ``keep`` by id."""
    kept = {row_id for row_id, _, age in rows if age < 1}
    for machine in {m for _, m, _ in rows}:
        ids = sorted(row_id for row_id, m, _ in rows if m == machine)
        kept |= set(ids[max(0, len(ids) - keep) :] if keep else [])
    return kept


async def row_ids(conn: bmdb.Connection, table: str) -> set[int]:
    async def fn(q: Queries) -> set[int]:
        return {r[0] for r in await q.execute(f"SELECT id FROM {table}")}

    return await conn.transact(fn)


@pytest.mark.parametrize("keep", [KEEP, 0])
async def test_prune_deletes_what_the_policy_does_not_keep(
    bmdb_conn: bmdb.Connection, keep: int
) -> None:
    written = await fill_old_rows(bmdb_conn)
    # Two rows per batch: the walk crosses machines and batches.
    policy = retention.RetentionPolicy(keep_last=keep, keep_newer_than=DAY, batch=2)
    dry = await retention.prune(bmdb_conn, policy, dry_run=True)
    for table, rows in written.items():
        assert await row_ids(bmdb_conn, table) == {r[0] for r in rows}, "a dry run deleted"
    progress: list[retention.PruneResult] = []
    done = await retention.prune(bmdb_conn, policy, progress=progress.append)
    for table, rows in written.items():
        kept = expected_kept(rows, keep)
        assert await row_ids(bmdb_conn, table) == kept
        [d] = [r for r in dry if r.table == table]
        [r] = [r for r in done if r.table == table]
        assert d.deleted == r.deleted == len(rows) - len(kept)
        assert d.dry_run and not r.dry_run
        assert r.kept_old == sum(1 for _, _, age in rows if age >= 1) - r.deleted
        assert r.batches > 1 and any(p.table == table for p in progress)
    # A second run finds nothing more.
    again = await retention.prune(bmdb_conn, policy)
    assert [r.deleted for r in again] == [0, 0]


async def test_prune_does_not_block_a_workers_claim_and_finish(
    bmdb_conn: bmdb.Connection, bmdb_url: str
) -> None:
    """A prune batch holds its transaction open (row locks on the old history
    of the very machine being claimed, and on its audit records): a claim,
    a finish and an operator's action on that machine all complete before
    the batch commits."""
    written = await fill_old_rows(bmdb_conn)
    machine = written["work_history"][0][1]
    assert machine is not None
    policy = {"keep": 0, "batch": 1000, "after": 0}
    with psycopg.connect(bmdb_url) as pruner:
        [(cutoff,)] = pruner.execute("SELECT now() - interval '1 day'").fetchall()
        deleted = 0
        for table in retention.TABLES:
            sql = retention._batch_sql(table, retention.TABLES[table], dry_run=False)
            [(_, _, gone)] = pruner.execute(sql.encode(), {**policy, "cutoff": cutoff}).fetchall()
            deleted += gone
        assert deleted > 0  # and uncommitted: its row locks are held

        # A safety bound: blocked, the worker would wait for the commit below.
        with trio.fail_after(60):
            async with bmdb_conn.session("test-worker") as sess:

                async def source(q: Queries) -> list[uuid.UUID]:
                    return [machine]

                work = await sess.work(Process.UNIT_TEST_1, source)
                async with work:
                    await work.finish()
            await actions.act(bmdb_conn, "hold", machine, operator="test", reason="while pruning")
        pruner.commit()

    async def events(q: Queries) -> list[str]:
        rows = await q.execute(
            "SELECT event::text FROM work_history WHERE machine_id = %s ORDER BY id", (machine,)
        )
        return [r[0] for r in rows]

    # The old rows went with the prune's commit; the worker's stayed.
    assert await bmdb_conn.transact(events) == ["Started", "Finished"]


def test_policy_refuses_bad_values() -> None:
    for kwargs, message in [
        ({"keep_last": -1, "keep_newer_than": DAY}, "keep_last must be 0 or more"),
        ({"keep_last": 1, "keep_newer_than": -DAY}, "non-negative age"),
        ({"keep_last": 1, "keep_newer_than": DAY, "batch": 0}, "batch must be 1 to 100000"),
    ]:
        with pytest.raises(InvalidArgument, match=message):
            retention.RetentionPolicy(**kwargs)  # type: ignore[arg-type]
    for text in ("90", "d", "-1d", "1w", "1e9d", ""):
        with pytest.raises(InvalidArgument):
            retention.parse_age(text)
    assert retention.parse_age("90d") == 90 * DAY
    assert retention.parse_age("1.5h") == datetime.timedelta(minutes=90)


async def test_prune_command(bmdb_conn: bmdb.Connection, bmdb_url: str) -> None:
    written = await fill_old_rows(bmdb_conn)
    before = {t: await row_ids(bmdb_conn, t) for t in retention.TABLES}
    for flags, message in [
        (["--keep-last", "-1", "--keep-newer-than", "1d"], "must be 0 or more, got -1"),
        (["--keep-last", "x", "--keep-newer-than", "1d"], "not a whole number: 'x'"),
        (["--keep-last", "3", "--keep-newer-than", "90"], "not an age: '90'"),
        (["--keep-last", "3"], "the following arguments are required: --keep-newer-than"),
        (["--keep-last", "3", "--keep-newer-than", "1d", "--batch", "0"], "1 to 100000"),
        (["--keep-last", "3", "--keep-newer-than", "1d", "--table", "machines"], "invalid choice"),
    ]:
        code, out, err = await cli("--url", bmdb_url, "prune", *flags)
        assert code == 2 and out == "", (flags, err)
        # The usage, then one line that says what is wrong.
        assert err.strip().splitlines()[-1].startswith("bmdb prune: error: ") and message in err
    assert {t: await row_ids(bmdb_conn, t) for t in retention.TABLES} == before

    keep = ["--keep-last", str(KEEP), "--keep-newer-than", "1d", "--table", "work_history"]
    code, out, err = await cli("--url", bmdb_url, "prune", *keep, "--dry-run")
    rows = written["work_history"]
    gone = len(rows) - len(expected_kept(rows, KEEP))
    assert (code, err) == (0, "")
    assert f"work_history: would delete {gone} rows" in out and "dry run" in out
    assert {t: await row_ids(bmdb_conn, t) for t in retention.TABLES} == before
    code, out, err = await cli("--url", bmdb_url, "prune", *keep)
    assert (code, err) == (0, "") and f"work_history: deleted {gone} rows" in out
    assert "audit_log" not in out
    assert await row_ids(bmdb_conn, "work_history") == expected_kept(rows, KEEP)
    assert await row_ids(bmdb_conn, "audit_log") == before["audit_log"]
