"""Retention of the work history and the audit trail: what is kept, and
how the rest is deleted without blocking anyone.

Both tables only grow: every claim, finish, failure and cancel appends to
``work_history``, every operator action to ``audit_log``. A
`RetentionPolicy` keeps, of each table, every row newer than
``keep_newer_than`` and, whatever their age, the newest ``keep_last`` rows
of each machine (rows without a machine, which only the audit log could
hold, count as one more machine); `prune` deletes the rest.

Why it never blocks workers: the rows deleted are old, and workers and
operator actions only insert history and audit rows; the one other
writer, forgetting a machine (whose history goes with it), waits at most
for one batch, or the batch for it. Each batch is one short statement in its own transaction
(READ COMMITTED, at most ``batch`` rows): it locks the rows it deletes and
nothing else; deleting a row that references a machine takes no lock on
the machine. So a claim or a finish never waits for a prune, and a prune
stopped halfway (cancelled, connection lost) leaves a consistent table
with fewer rows; the next run carries on.

The walk: rows in id order (the primary key), from the oldest, in batches
of ``batch`` ids, until a batch holds no row older than the cutoff (ids
follow time); the cutoff is taken once, from the database's clock, when
the run starts. Each row is
checked against its machine's newest ``keep_last`` through the
``(machine_id, id)`` index, so a batch costs ``batch`` index probes of at
most ``keep_last`` entries. A run reads every row older than the cutoff,
the kept ones too: its cost is that of the old rows, not of the table.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bmdb.errors import InvalidArgument
from bmdb.model.enums import Isolation

if TYPE_CHECKING:
    # Types only: the CLI reads this module's policy words (TABLES,
    # DEFAULT_BATCH, parse_age) before it connects, without the driver.
    from bmdb.connection import Connection
    from bmdb.model import Queries

logger = logging.getLogger("bmdb.retention")

#: The tables `prune` trims, each with its time column.
TABLES = {"work_history": "at", "audit_log": "at"}

#: Rows deleted per transaction by default: small enough that a batch is a
#: few milliseconds of locks and WAL, large enough that a day's rows of a
#: big fleet take few round trips.
DEFAULT_BATCH = 1000

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)\s*$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_age(text: str) -> datetime.timedelta:
    """``"90d"``, ``"12h"``, ``"30m"``, ``"45s"``: a non-negative age.

    Raises `InvalidArgument` with what is wrong for anything else."""
    match = _DURATION.match(text)
    if match is None:
        raise InvalidArgument(f"not an age: {text!r} (a number and a unit: s, m, h or d, e.g. 90d)")
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if seconds > 100 * 365 * 86400:
        raise InvalidArgument(f"age {text!r} is over 100 years")
    return datetime.timedelta(seconds=seconds)


@dataclass(frozen=True)
class RetentionPolicy:
    """What `prune` keeps: every row newer than ``keep_newer_than``, and the
    newest ``keep_last`` of each machine whatever their age."""

    keep_last: int
    keep_newer_than: datetime.timedelta
    #: Rows per transaction.
    batch: int = DEFAULT_BATCH

    def __post_init__(self) -> None:
        if not isinstance(self.keep_last, int) or self.keep_last < 0:
            raise InvalidArgument(f"keep_last must be 0 or more, got {self.keep_last!r}")
        if (
            not isinstance(self.keep_newer_than, datetime.timedelta)
            or self.keep_newer_than < datetime.timedelta()
        ):
            raise InvalidArgument(
                f"keep_newer_than must be a non-negative age, got {self.keep_newer_than!r}"
            )
        if not isinstance(self.batch, int) or not 1 <= self.batch <= 100_000:
            raise InvalidArgument(f"batch must be 1 to 100000 rows, got {self.batch!r}")


@dataclass(frozen=True)
class PruneResult:
    """What `prune` did (or, dry, would do) to one table."""

    table: str
    #: Rows deleted (dry run: rows it would delete).
    deleted: int
    #: Rows older than the cutoff that were kept: a machine's newest.
    kept_old: int
    #: Transactions it took (dry run: batches it read).
    batches: int
    cutoff: datetime.datetime
    dry_run: bool


def _batch_sql(table: str, time_column: str, dry_run: bool) -> str:
    """One batch of `prune` on ``table``: the ``%(batch)s`` rows after id
    ``%(after)s``; of them the old (before ``%(cutoff)s``) that are not among
    their machine's newest ``%(keep)s`` (a row is, unless ``keep`` newer
    rows of its machine exist) are deleted (dry run: counted). Returns the
    batch's last id, how many of it were old, and how many went."""

    def newer(machine: str) -> str:
        return f"""(SELECT count(*) FROM (
                        SELECT 1 FROM {table} n WHERE n.machine_id {machine} AND n.id > b.id
                        LIMIT %(keep)s) x)"""

    doomed = f"""
        SELECT b.id FROM batch b
        WHERE b.old AND %(keep)s <= CASE WHEN b.machine_id IS NULL THEN {newer("IS NULL")}
                                         ELSE {newer("= b.machine_id")} END
    """
    gone = doomed if dry_run else f"DELETE FROM {table} WHERE id IN ({doomed}) RETURNING id"
    return f"""
        WITH batch AS (
            SELECT t.id, t.machine_id, t.{time_column} < %(cutoff)s AS old FROM {table} t
            WHERE t.id > %(after)s ORDER BY t.id LIMIT %(batch)s
        ), gone AS ({gone})
        SELECT (SELECT max(id) FROM batch), (SELECT count(*) FROM batch WHERE old),
               (SELECT count(*) FROM gone)
    """


async def prune(
    conn: Connection,
    policy: RetentionPolicy,
    *,
    tables: Sequence[str] = tuple(TABLES),
    dry_run: bool = False,
    progress: Callable[[PruneResult], None] | None = None,
) -> list[PruneResult]:
    """Delete from each of ``tables`` the rows ``policy`` does not keep, in
    batches of ``policy.batch`` rows, each its own transaction; or, with
    ``dry_run``, count them and delete nothing.

    ``progress`` is called after every batch with the table's totals so far.
    The walk of a table ends at the first batch without a row older than the
    cutoff (ids follow time): a row whose time is older than that of rows
    inserted more than a batch before it waits for a later run.

    Raises `InvalidArgument` for an unknown table (before touching any), and
    the connection's errors (`bmdb.errors.BMDBError`) as they come: what
    earlier batches deleted stays deleted. Cancellation stops it between or
    within a batch; a batch cancelled midway is rolled back whole.
    """
    unknown = [t for t in tables if t not in TABLES]
    if unknown:
        raise InvalidArgument(f"no retention for {', '.join(unknown)}; only {', '.join(TABLES)}")
    return [await _prune_table(conn, t, policy, dry_run, progress) for t in tables]


async def _prune_table(
    conn: Connection,
    table: str,
    policy: RetentionPolicy,
    dry_run: bool,
    progress: Callable[[PruneResult], None] | None,
) -> PruneResult:
    sql = _batch_sql(table, TABLES[table], dry_run)

    async def cutoff_of(q: Queries) -> datetime.datetime:
        [(cutoff,)] = await q.execute("SELECT now() - %s", (policy.keep_newer_than,))
        assert isinstance(cutoff, datetime.datetime)
        return cutoff

    cutoff = await conn.transact(cutoff_of, isolation=Isolation.READ_COMMITTED)
    params: dict[str, object] = {
        "cutoff": cutoff,
        "keep": policy.keep_last,
        "batch": policy.batch,
        "after": 0,
    }
    result = PruneResult(table, 0, 0, 0, cutoff, dry_run)

    async def one_batch(q: Queries) -> tuple[int | None, int, int]:
        [(last, old, gone)] = await q.execute(sql, params)
        return last, int(old), int(gone)

    while True:
        last, old, gone = await conn.transact(one_batch, isolation=Isolation.READ_COMMITTED)
        if last is None or old == 0:
            break
        params["after"] = last
        result = dataclasses.replace(
            result,
            deleted=result.deleted + gone,
            kept_old=result.kept_old + old - gone,
            batches=result.batches + 1,
        )
        if progress is not None:
            progress(result)
    logger.info(
        "%s: %s %d rows older than %s, kept %d (a machine's newest), in %d batches",
        table,
        "would delete" if dry_run else "deleted",
        result.deleted,
        cutoff.isoformat(timespec="seconds"),
        result.kept_old,
        result.batches,
    )
    return result
