"""The hot statements' plans at fleet scale: a claim's cost does not grow
with the fleet.

Each statement is run under ``EXPLAIN (ANALYZE, BUFFERS)`` (inside a
transaction that is rolled back) on a fleet built in bulk with
``generate_series``: 100,000 provided machines, the oldest 90% with their
agent started and heartbeating, every 50th with an agent-start backoff.
Each test checks two things: no ``Seq Scan`` of a table that grows with
the fleet, and the buffers read within a budget set by how many
candidates the statement looks at (a few index probes of 3 to 4 buffers
each per candidate), not by the fleet: a walk over the fleet reads
hundreds of thousands. Buffers, not time: the tests never assert on time.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from bmdb import Process, overview
from bmdb.localserver import TEMPLATE_DB, LocalPostgres
from bmdb.model import sourcing
from bmdb.work import CLAIM_SQL, RELEASE_SQL

SMALL = 1_000
LARGE = 100_000

#: Buffers a statement may read per candidate machine it looks at.
PER_CANDIDATE = 16

#: Tables whose size is the fleet's: a sequential scan of one is a cost per
#: claim that grows with the fleet.
FLEET_TABLES = {
    "machines",
    "machine_provided",
    "machine_agent_started",
    "machine_agent_heartbeat",
    "work_history",
    "audit_log",
}

SESSION = uuid.UUID(int=1)

# Triggers off (session_replication_role) so that the mirrored
# machines.agent_started is written with the row, not by 90,000 updates.
_FLEET = """
SET session_replication_role = replica;
INSERT INTO machines (machine_created_at, agent_started)
SELECT now() - interval '1 day' + make_interval(secs => g / 1000.0), g <= {n} * 0.9
FROM generate_series(1, {n}) g;
INSERT INTO machine_provided (machine_id, provider, provider_id)
SELECT machine_id, 'Static', machine_id::text FROM machines;
INSERT INTO machine_agent_started (machine_id, agent_started_at, agent_public_key,
                                   agent_seen_floor)
SELECT machine_id, now() - interval '2 hours', '\\x00'::bytea, agent_seen_floor(now(), machine_id)
FROM machines WHERE agent_started;
INSERT INTO machine_agent_heartbeat (machine_id, agent_heartbeat_at)
SELECT machine_id, now() FROM machines WHERE agent_started;
INSERT INTO work_backoff (machine_id, process, until, cause, last_interval_seconds)
SELECT machine_id, 'ShepherdAgentStart', now() + interval '1 day', 'test', 86400
FROM (SELECT machine_id, row_number() OVER (ORDER BY machine_created_at) n FROM machines) m
WHERE n % 50 = 0;
INSERT INTO sessions (session_id, session_component_name, session_runtime_info,
                      session_interval_seconds, session_deadline)
VALUES ('{session}', 'test', '', 10, now() + interval '1 hour');
SET session_replication_role = DEFAULT
"""


@pytest.fixture(scope="module")
def fleets(postgres_server: LocalPostgres) -> Iterator[dict[int, str]]:
    """libpq URLs of the fleets, by size."""
    if not postgres_server.running:
        postgres_server.start()
    names = {n: f"plans_{n}" for n in (SMALL, LARGE)}
    for n, name in names.items():
        postgres_server.admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        postgres_server.admin(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE_DB}")
        with psycopg.connect(postgres_server.url(name), autocommit=True) as conn:
            for statement in _FLEET.format(n=n, session=SESSION).split(";\n"):
                conn.execute(statement.encode())
            conn.execute("VACUUM ANALYZE")
    yield {n: postgres_server.url(name) for n, name in names.items()}
    for name in names.values():
        postgres_server.admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def _explain(
    url: str, sql: str, params: dict[str, object] | None, setup: str | None = None
) -> dict[str, Any]:
    """The executed plan of ``sql`` (rolled back, after ``setup`` in the same
    transaction), with its buffer counts."""
    with psycopg.connect(url) as conn:
        if setup is not None:
            for statement in setup.split(";\n"):
                conn.execute(statement.encode())
        if params is not None and "machine" in params:
            # The newest machine: one the agent-start source would offer last.
            [(params["machine"],)] = conn.execute(
                "SELECT machine_id FROM machines ORDER BY machine_created_at DESC LIMIT 1"
            ).fetchall()
        # Twice: the first run may set hint bits and prune; the second is the
        # steady state a worker sees.
        for _ in range(2):
            [(result,)] = conn.execute(
                ("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql).encode(), params
            ).fetchall()
        conn.rollback()
        if setup is not None:
            # The rolled-back setup left dead row versions (an UPDATE of every
            # heartbeat: 100,000), and its ANALYZE wrote pg_class's row and
            # page counts in place (not rolled back): without a VACUUM the
            # next test, whichever xdist runs next, plans and reads on them.
            conn.autocommit = True
            conn.execute(b"VACUUM (ANALYZE)")
    plan: dict[str, Any] = result[0]["Plan"]
    return plan


def _check_flat(
    fleets: dict[int, str],
    sql: str,
    params: dict[str, object] | None,
    candidates: int,
    setup: str | None = None,
) -> None:
    """No sequential scan of a fleet table at `LARGE`, and at both sizes at
    most `PER_CANDIDATE` buffers per candidate: the same bound at 1,000 and
    at 100,000 machines."""
    plans = {n: _explain(url, sql, params, setup) for n, url in fleets.items()}
    scans = sorted(
        {
            node["Relation Name"]
            for node in _nodes(plans[LARGE])
            if node["Node Type"] == "Seq Scan" and node["Relation Name"] in FLEET_TABLES
        }
    )
    assert not scans, f"sequential scans of fleet tables: {scans}"
    # The most of any node: a node's count includes its children's but not
    # always its CTEs' (a data-modifying CTE is counted on its own node).
    budget = PER_CANDIDATE * candidates
    for n, plan in plans.items():
        read = max(node["Shared Hit Blocks"] + node["Shared Read Blocks"] for node in _nodes(plan))
        assert read <= budget, f"{sql}: {read} buffers read at {n} machines, budget {budget}"


_BUSY = [str(Process.SHEPHERD_AGENT_START), str(Process.SHEPHERD_RECOVERY)]
_CLAIM = {"session": SESSION, "process": str(Process.SHEPHERD_AGENT_START), "machine": None}


def test_initializer_locking_source_is_flat(fleets: dict[int, str]) -> None:
    _check_flat(fleets, sourcing.agent_start_lock_sql(1), None, sourcing.SOURCING_WINDOW)


def test_initializer_listing_source_is_flat(fleets: dict[int, str]) -> None:
    params = {"limit": 100, "busy": _BUSY, "process": str(Process.SHEPHERD_AGENT_START)}
    _check_flat(fleets, sourcing._AGENT_START_LIST, params, 100)


def test_work_claim_is_flat(fleets: dict[int, str]) -> None:
    _check_flat(fleets, CLAIM_SQL, dict(_CLAIM), 1)


def test_work_release_is_flat(fleets: dict[int, str]) -> None:
    _check_flat(fleets, RELEASE_SQL, _CLAIM | {"event": "Finished", "cause": None}, 1)


def _recovery_sql(locking: bool, provider: str | None) -> str:
    """The recovery source: locking (one of a window, as the recoverer's loop
    claims) or listing (100, outside a claim), of every provider or of one
    (as the recoverer asks: the statement has one more join)."""
    return sourcing._agent_recovery(
        1 if locking else 100,
        provider,
        sourcing.AGENT_FIRST_HEARTBEAT_TIMEOUT,
        sourcing.AGENT_HEARTBEAT_TIMEOUT,
        locking,
    )


#: The recoverer asks for its provider's machines only.
_PROVIDERS = pytest.mark.parametrize("provider", [None, "Static"], ids=["any", "static"])


@_PROVIDERS
@pytest.mark.parametrize("locking", [True, False], ids=["locking", "listing"])
def test_recoverer_source_is_flat(
    fleets: dict[int, str], locking: bool, provider: str | None
) -> None:
    sql = _recovery_sql(locking, provider)
    _check_flat(fleets, sql, None, sourcing.SOURCING_WINDOW if locking else 100)


# One machine in a hundred silent for an hour, every other one of them in a
# recovery backoff (the source walks past those), and three operator
# requests: the source reads its window plus what it skips, whatever the fleet.
_SILENT = """
UPDATE machine_agent_heartbeat SET agent_heartbeat_at = now() - interval '1 hour'
WHERE machine_id IN (SELECT machine_id FROM machines WHERE agent_started
                     ORDER BY machine_created_at LIMIT (SELECT count(*) / 100 FROM machines));
INSERT INTO work_backoff (machine_id, process, until, cause, last_interval_seconds)
SELECT machine_id, 'ShepherdRecovery', now() + interval '1 hour', 'test', 3600
FROM machine_agent_heartbeat WHERE agent_heartbeat_at < now() - interval '30 minutes'
  AND get_byte(uuid_send(machine_id), 15) % 2 = 0
ON CONFLICT DO NOTHING;
INSERT INTO machine_recovery_request (machine_id, requested_by)
SELECT machine_id, 'test' FROM machines WHERE agent_started
ORDER BY machine_created_at DESC LIMIT 3
"""


@_PROVIDERS
@pytest.mark.parametrize("locking", [True, False], ids=["locking", "listing"])
def test_recoverer_source_with_silent_machines_is_flat(
    fleets: dict[int, str], locking: bool, provider: str | None
) -> None:
    sql = _recovery_sql(locking, provider)
    window = sourcing.SOURCING_WINDOW if locking else 100
    # The window is looked at twice (sourced, then joined for its columns),
    # and about as many again are skipped for their backoff.
    _check_flat(fleets, sql, None, 3 * window, _SILENT)


# Every agent silent for an hour (the callback server was down), with the
# planner's statistics saying so: the source still reads only its window.
_ALL_SILENT = """
UPDATE machine_agent_heartbeat SET agent_heartbeat_at = now() - interval '1 hour';
ANALYZE machine_agent_started;
ANALYZE machine_agent_heartbeat
"""


@_PROVIDERS
@pytest.mark.parametrize("locking", [True, False], ids=["locking", "listing"])
def test_recoverer_source_with_every_machine_silent_is_flat(
    fleets: dict[int, str], locking: bool, provider: str | None
) -> None:
    sql = _recovery_sql(locking, provider)
    window = sourcing.SOURCING_WINDOW if locking else 100
    # The window, looked at twice (sourced, then joined for its columns).
    _check_flat(fleets, sql, None, 2 * window, _ALL_SILENT)


# Every machine's agent start in the history (Started, Finished), as the
# page reads it for each machine's last failure.
_HISTORY = """
INSERT INTO work_history (machine_id, process, event, at)
SELECT machine_id, 'ShepherdAgentStart', e::work_history_event, now()
FROM machines, unnest(ARRAY['Started', 'Finished']) e;
ANALYZE work_history
"""


def test_first_machine_page_is_flat_and_planned_once(fleets: dict[int, str]) -> None:
    """The web UI's first page of machines (and ``bmdb machines``): a statement
    without parameters, so that PostgreSQL plans it once per connection (a
    generic plan of ``LIMIT $n`` or of ``$n IS NULL OR ...`` filters sorts
    the fleet; a custom plan costs more to plan than to run), reading its
    hundred machines with a few index probes each."""
    sql = overview.machines_sql(overview.machines_params(limit=101))
    assert "%(" not in sql
    # Each machine is probed in about ten tables (tags, hold, installation,
    # backoff, history, work): a few candidates' worth of buffers each.
    _check_flat(fleets, sql, None, 4 * 101, _HISTORY)


def test_failed_machines_page_is_served_by_an_index(fleets: dict[int, str]) -> None:
    """The web UI's ``/machines?state=failed``: the active backoffs are found
    through an index and only the page's machines get their joins, not every
    machine walked until a hundred failed ones are found (one in 50 here)."""
    params = overview.machines_params(limit=101, state="failed")
    sql = overview.machines_sql(params)
    plan = _explain(fleets[LARGE], sql, params, _HISTORY)
    backoff_scans = {
        node["Node Type"] for node in _nodes(plan) if node.get("Relation Name") == "work_backoff"
    }
    assert backoff_scans and backoff_scans <= {
        "Index Scan",
        "Index Only Scan",
        "Bitmap Heap Scan",
    }, backoff_scans
    # The history is read for the page's machines only.
    history_loops = max(
        node["Actual Loops"] for node in _nodes(plan) if node.get("Relation Name") == "work_history"
    )
    assert history_loops <= 101
    # The machines are walked in order with one backoff probe each until a
    # page is found: 50 per failed machine here, whatever the fleet's size.
    _check_flat(fleets, sql, params, 50 * 101 // 4, _HISTORY)


# Half the fleet failed once and its backoff ended long ago (the rows stay
# until the process next finishes there), the fleet's own backoffs ended
# too, and the 30 newest machines are failing now. Committed and vacuumed,
# as a fleet is: rewritten within the explained transaction, the ended
# backoffs' old index entries would still be live to it.
_FEW_FAILED = (
    """
UPDATE work_backoff SET until = now() - interval '1 hour';
INSERT INTO work_backoff (machine_id, process, until, cause, last_interval_seconds)
SELECT machine_id, 'ShepherdRecovery', now() - interval '2 hours', 'ended', 60 FROM machines
WHERE get_byte(uuid_send(machine_id), 15) % 2 = 0
ON CONFLICT DO NOTHING;
INSERT INTO work_backoff (machine_id, process, until, cause, last_interval_seconds)
SELECT machine_id, 'ShepherdAgentStart', now() + interval '1 hour', 'failing', 3600
FROM machines ORDER BY machine_created_at DESC LIMIT 30
ON CONFLICT (machine_id, process) DO UPDATE SET until = EXCLUDED.until;"""
    + _HISTORY
)


@pytest.fixture(scope="module")
def few_failed(fleets: dict[int, str], postgres_server: LocalPostgres) -> Iterator[dict[int, str]]:
    """The fleets, copied, with `_FEW_FAILED` committed: libpq URLs by size."""
    names = {n: f"plans_few_failed_{n}" for n in fleets}
    for n, name in names.items():
        postgres_server.admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        postgres_server.admin(f"CREATE DATABASE {name} TEMPLATE plans_{n}")
        with psycopg.connect(postgres_server.url(name), autocommit=True) as conn:
            for statement in _FEW_FAILED.split(";\n"):
                conn.execute(statement.encode())
            conn.execute("VACUUM ANALYZE")
    yield {n: postgres_server.url(name) for n, name in names.items()}
    for name in names.values():
        postgres_server.admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_a_few_failed_machines_are_found_by_their_backoffs_end(
    few_failed: dict[int, str],
) -> None:
    """``/machines?state=failed`` when few machines fail now among many old
    failures: the active backoffs come from migration 0009's index on their
    end, not from reading every backoff row nor from walking the fleet in
    order (the failing machines are the newest: a walk would read them all)."""
    params = overview.machines_params(limit=101, state="failed")
    sql = overview.machines_sql(params)
    plan = _explain(few_failed[LARGE], sql, params)
    assert plan["Actual Rows"] == 30
    indexes = {node.get("Index Name") for node in _nodes(plan)}
    assert "work_backoff_until" in indexes, indexes
    # A row per machine and process that failed there, kept until the
    # process next finishes: a table that grows with the fleet.
    assert not [
        node
        for node in _nodes(plan)
        if node["Node Type"] == "Seq Scan" and node["Relation Name"] == "work_backoff"
    ]
    # The page's 30 machines and their joins, at 1,000 machines as at 100,000.
    _check_flat(few_failed, sql, params, 101)
