"""The Shepherd's pruner: the retention policy on a schedule."""

from __future__ import annotations

import datetime

import pytest
import trio

import bmdb
from bmdb.retention import TABLES, RetentionPolicy
from shepherd.pruner import Pruner, PrunerConfig
from tests.bmdb.helpers import eventually
from tests.bmdb.test_retention import KEEP, expected_kept, fill_old_rows, row_ids


async def test_pruner_prunes_at_once_then_on_its_schedule(bmdb_conn: bmdb.Connection) -> None:
    written = await fill_old_rows(bmdb_conn)
    policy = RetentionPolicy(keep_last=KEEP, keep_newer_than=datetime.timedelta(days=1))
    pruner = Pruner(bmdb_conn, PrunerConfig(policy, interval=3600.0))

    async def pruned() -> bool:
        return [await row_ids(bmdb_conn, t) for t in written] == [
            expected_kept(rows, KEEP) for rows in written.values()
        ]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pruner.run)
        await eventually(pruned)
        nursery.cancel_scope.cancel()
    # A round finds nothing more to delete.
    assert [r.deleted for r in await pruner.round()] == [0] * len(TABLES)


def test_pruner_config_refuses_a_bad_interval() -> None:
    policy = RetentionPolicy(keep_last=1, keep_newer_than=datetime.timedelta(days=1))
    with pytest.raises(ValueError, match="interval must be positive"):
        PrunerConfig(policy, interval=0)
