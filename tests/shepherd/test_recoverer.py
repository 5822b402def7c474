"""The recoverer on a BMDB: which machines it takes, what it asks the provider, what it clears."""

from __future__ import annotations

import datetime
import uuid
from pathlib import Path
from typing import Any

import pytest
import trio

import bmdb
from bmdb import Backoff, Process, Queries, WorkEvent
from bmdb._pg import Params, Row
from bmdb.model import AgentStarted
from bmdb.model.sourcing import SOURCING_WINDOW
from shepherd.control_loop import LoopStats, run_control_loop
from shepherd.providers import Capability, Machine, PowerState, ProviderError
from shepherd.providers.redfish import Credentials, RedfishClient, load_credentials
from shepherd.providers.static import StaticProvider
from shepherd.rate_limit import Rate, RateLimiter
from shepherd.recoverer import DEFAULT_BACKOFF, Recoverer
from tests.fixtures.sushy import PASSWORD, SYSTEMS, USERNAME, Sushy
from tests.shepherd.helpers import backoffs, events, provide

KEY = bytes(range(32))


class RebootingProvider(StaticProvider):
    """The static list, plus a reboot that is recorded (or fails, for ``broken`` ids)."""

    def __init__(self, machines: list[Machine], broken: set[str]) -> None:
        super().__init__(machines)
        self.rebooted: list[str] = []
        self.broken = broken

    @property
    def capabilities(self) -> frozenset[Capability]:
        return frozenset({Capability.REBOOT})

    async def reboot(self, machine_id: str) -> None:
        if machine_id in self.broken:
            raise ProviderError(f"BMC of {machine_id} does not answer")
        self.rebooted.append(machine_id)


def test_default_backoff_is_the_references() -> None:
    assert Backoff(initial=60, maximum=3600, exponent=1.2) == DEFAULT_BACKOFF


async def _machines(conn: bmdb.Connection) -> dict[str, uuid.UUID]:
    """silent (no heartbeat, started long ago), stale (old heartbeat), fresh, broken."""
    ids = await provide(conn, ["silent", "stale", "fresh", "broken"])
    now = datetime.datetime.now(datetime.UTC)
    hour = datetime.timedelta(hours=1)

    async def setup(q: Queries) -> None:
        for name, mid in ids.items():
            await q.set_agent_started(mid, now - hour, KEY)
            if name != "silent":
                beat = now if name == "fresh" else now - hour
                await q.set_agent_heartbeat(mid, beat)

    await conn.transact(setup)
    return ids


async def _run(conn: bmdb.Connection, recoverer: Recoverer, ids: list[uuid.UUID]) -> None:
    async def done() -> bool:
        for mid in ids:
            history = await events(conn, mid, Process.SHEPHERD_RECOVERY)
            if not any(e in (WorkEvent.FINISHED, WorkEvent.FAILED) for e, _ in history):
                return False
        return True

    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: run_control_loop(
                conn, recoverer, parallelism=2, limiter=RateLimiter(Rate(0.005, 8))
            )
        )
        with trio.fail_after(60):
            while not await done():  # noqa: ASYNC110 (the state is in Postgres)
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()


async def _tags(conn: bmdb.Connection, mid: uuid.UUID) -> tuple[bool, bool]:
    async def read(q: Queries) -> tuple[bool, bool]:
        return (await q.agent_started(mid) is not None, await q.agent_heartbeat(mid) is not None)

    return await conn.transact(read)


@pytest.mark.parametrize("can_reboot", [True, False], ids=["rebooting", "static"])
async def test_silent_agents_are_recovered(bmdb_conn: bmdb.Connection, can_reboot: bool) -> None:
    ids = await _machines(bmdb_conn)
    machines = [Machine(name, "192.0.2.1") for name in ids]
    provider = (
        RebootingProvider(machines, broken={"broken"}) if can_reboot else StaticProvider(machines)
    )
    recoverer = Recoverer(provider)
    await _run(bmdb_conn, recoverer, [ids["silent"], ids["stale"], ids["broken"]])

    for name in ("silent", "stale"):
        assert await events(bmdb_conn, ids[name], Process.SHEPHERD_RECOVERY) == [
            (WorkEvent.STARTED, ""),
            (WorkEvent.FINISHED, ""),
        ]
        assert await _tags(bmdb_conn, ids[name]) == (False, False)
    # A healthy agent is left alone.
    assert await events(bmdb_conn, ids["fresh"], Process.SHEPHERD_RECOVERY) == []
    assert await _tags(bmdb_conn, ids["fresh"]) == (True, True)
    broken = await events(bmdb_conn, ids["broken"], Process.SHEPHERD_RECOVERY)
    recovery_backoff = await backoffs(bmdb_conn, Process.SHEPHERD_RECOVERY)
    if can_reboot:
        assert isinstance(provider, RebootingProvider)
        assert sorted(provider.rebooted) == ["silent", "stale"]
        # A failed reboot keeps the tags (nothing was done) and backs off.
        assert [e for e, _ in broken] == [WorkEvent.STARTED, WorkEvent.FAILED]
        assert "BMC of broken does not answer" in broken[1][1]
        assert recovery_backoff[ids["broken"]][0] == DEFAULT_BACKOFF.next()
        assert await _tags(bmdb_conn, ids["broken"]) == (True, True)
    else:
        assert [e for e, _ in broken] == [WorkEvent.STARTED, WorkEvent.FINISHED]
        assert recovery_backoff == {}


async def test_recovery_is_per_provider(bmdb_conn: bmdb.Connection) -> None:
    """A recoverer leaves machines of other providers alone."""
    ids = await _machines(bmdb_conn)

    class OtherProvider(StaticProvider):
        @property
        def type(self) -> str:
            return "Equinix"

    recoverer = Recoverer(OtherProvider([]))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: run_control_loop(
                bmdb_conn, recoverer, parallelism=1, limiter=RateLimiter(Rate(0.005, 8))
            )
        )
        await trio.sleep(1.0)
        nursery.cancel_scope.cancel()
    for mid in ids.values():
        assert await events(bmdb_conn, mid, Process.SHEPHERD_RECOVERY) == []


# What one recovery costs the database, as the loop runs it. The loop's source
# is the locking statement (a window of `SOURCING_WINDOW` candidates, one
# picked at random and locked) in the claiming transaction: a statement
# other than the listing one that stops at the first silent machine. Once it
# walked the fleet in creation order with a heartbeat probe per machine until
# it had its window: at 100,000 machines with every 1,000th silent, 0.9 s and
# half a million buffers per claim, which held the loop to one recovery in
# 1.1 s where its rate allows four a second (issue 30).

#: Machines heartbeating now, created before the silent ones: a source that
#: walks the fleet in creation order reads several buffers for each.
LIVE = 2000
SILENT = 3
#: Buffers a source may read per candidate it looks at (as in
#: tests/bmdb/test_plans.py); the window bounds the candidates, not the fleet.
PER_CANDIDATE = 16

_FLEET = f"""
WITH made AS (
    INSERT INTO machines (machine_created_at)
    SELECT now() - interval '1 day' + make_interval(secs => g)
    FROM generate_series(1, {LIVE + SILENT}) g
    RETURNING machine_id, machine_created_at
), provided AS (
    INSERT INTO machine_provided (machine_id, provider, provider_id)
    SELECT machine_id, 'Static', machine_id::text FROM made
)
INSERT INTO machine_agent_heartbeat (machine_id, agent_heartbeat_at)
SELECT machine_id,
       CASE WHEN row_number() OVER (ORDER BY machine_created_at) > {LIVE}
            THEN now() - interval '1 hour' ELSE now() END
FROM made
"""

# After the heartbeats, so that each started row takes its floor from its
# heartbeat at once (migration 0007's trigger), as after a fleet's bring-up.
_STARTED = """
INSERT INTO machine_agent_started (machine_id, agent_started_at, agent_public_key)
SELECT machine_id, now() - interval '2 hours', '\\x00'::bytea FROM machines
"""


def _most_buffers(plan: dict[str, Any]) -> int:
    """The most buffers any node of ``plan`` read (a node counts its children's)."""
    own = int(plan["Shared Hit Blocks"]) + int(plan["Shared Read Blocks"])
    return max([own, *(_most_buffers(child) for child in plan.get("Plans", []))])


class _Explaining:
    """An executor that runs each statement under ``EXPLAIN (ANALYZE, BUFFERS)``
    first, in the same transaction (the same snapshot), records what it read,
    then runs it for real."""

    user = "test"

    def __init__(self, q: Queries, reads: list[int]) -> None:
        self._q = q
        self._reads = reads

    async def execute(self, query: str, params: Params | None = None) -> list[Row]:
        explain = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query
        [(result,)] = await self._q.execute(explain, params)
        self._reads.append(_most_buffers(result[0]["Plan"]))
        return await self._q.execute(query, params)


class _MeasuredRecoverer(Recoverer):
    """The recoverer, recording the buffers its source reads on every claim."""

    def __init__(self, provider: StaticProvider) -> None:
        super().__init__(provider)
        self.reads: list[int] = []

    async def source(self, q: Queries) -> AgentStarted | None:
        return await super().source(Queries(_Explaining(q, self.reads), locking=q.locking))


async def test_a_recovery_costs_one_claim_and_a_window_of_candidates_whatever_the_fleet(
    bmdb_conn: bmdb.Connection,
) -> None:
    """The loop recovers each silent machine with one claim, and each claim's
    source reads a bounded window of candidates, not the fleet before them."""

    async def seed(q: Queries) -> list[uuid.UUID]:
        await q.execute(_FLEET)
        await q.execute(_STARTED)
        await q.execute("ANALYZE")  # as autovacuum would have, on a fleet this size
        rows = await q.execute(
            "SELECT machine_id FROM machines ORDER BY machine_created_at DESC LIMIT %s", (SILENT,)
        )
        return [r[0] for r in rows]

    silent = await bmdb_conn.transact(seed)
    recoverer = _MeasuredRecoverer(StaticProvider([]))
    stats = LoopStats()
    claims0 = bmdb_conn.stats.claims

    async def recovered() -> int:
        async def count(q: Queries) -> int:
            rows = await q.execute(
                "SELECT count(*) FROM machine_agent_started WHERE machine_id = ANY(%s)", (silent,)
            )
            return SILENT - int(rows[0][0])

        return await bmdb_conn.transact(count)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: run_control_loop(
                bmdb_conn,
                recoverer,
                parallelism=1,
                limiter=RateLimiter(Rate(0.005, 8)),
                stats=stats,
            )
        )
        with trio.fail_after(60):
            while await recovered() < SILENT:  # noqa: ASYNC110 (the state is in Postgres)
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()

    component = recoverer.component
    # One claim per recovered machine: none lost to a conflict or a lost session.
    assert stats.iterations[component, "worked"] == SILENT
    assert stats.iterations[component, "conflict"] == 0
    assert stats.iterations[component, "session_lost"] == 0
    assert bmdb_conn.stats.claims - claims0 == SILENT
    for mid in silent:
        assert await events(bmdb_conn, mid, Process.SHEPHERD_RECOVERY) == [
            (WorkEvent.STARTED, ""),
            (WorkEvent.FINISHED, ""),
        ]
    # Every claim's source (and every one that found nothing after the last)
    # read at most its window's worth; a walk over the 2,000 live machines
    # before the silent ones reads several times that.
    budget = PER_CANDIDATE * SOURCING_WINDOW
    assert len(recoverer.reads) >= SILENT
    assert max(recoverer.reads) <= budget, recoverer.reads


# Through a real BMC: sushy-tools' emulator behind a static machine list.


def _bmc_provider(tmp_path: Path, sushy: Sushy, systems: dict[str, str | None]) -> StaticProvider:
    """A static provider loaded from files, as ``python -m shepherd --provider static`` does.

    ``systems`` maps machine id to sushy system (None: no BMC). The BMC credentials are in
    their own file: the default is right, machine ``bad``'s password is wrong.
    """
    machines = tmp_path / "machines.toml"
    machines.write_text(
        "".join(
            f'[[machine]]\nid = "{mid}"\naddress = "192.0.2.1"\n'
            + (f'bmc = "{sushy.system_url(system)}"\n' if system else "")
            for mid, system in systems.items()
        )
    )
    credentials = tmp_path / "bmc.toml"
    credentials.write_text(
        f'[default]\nusername = "{USERNAME}"\npassword = "{PASSWORD}"\n'
        f'[machine."bad"]\nusername = "{USERNAME}"\npassword = "wrong"\n'
    )
    return StaticProvider.from_file(machines, credentials=load_credentials(credentials, environ={}))


async def _power(sushy: Sushy, system: str) -> PowerState:
    """The system's power state, read from the BMC itself (not through the provider)."""
    async with RedfishClient() as redfish:
        return await redfish.power_state(sushy.system_url(system), Credentials(USERNAME, PASSWORD))


async def _wait_power(sushy: Sushy, system: str, want: PowerState) -> None:
    with trio.fail_after(60):  # the fake driver applies a reset 1..11 s later
        while await _power(sushy, system) != want:  # noqa: ASYNC110 (state is in the BMC)
            await trio.sleep(0.2)


async def _start_silent_agent(conn: bmdb.Connection, mid: uuid.UUID, ago: float) -> None:
    """AgentStarted ``ago`` seconds back, and never a heartbeat."""
    at = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=ago)

    async def start(q: Queries) -> None:
        await q.set_agent_started(mid, at, KEY)

    await conn.transact(start)


async def test_silent_machine_is_power_cycled_through_its_bmc(
    bmdb_conn: bmdb.Connection, sushy: Sushy, tmp_path: Path
) -> None:
    """The recoverer resets the machine's Redfish system, then clears its agent tags.

    The system is off (the likeliest reason for silence): sushy's fake driver
    then turns it on a few seconds after the reset, and only a reset does,
    so the test cannot pass unless the recoverer asked the BMC. (A system
    that is on cannot show this robustly: the fake driver's off phase of a
    ForceRestart may last a fraction of a second.)
    """
    system = SYSTEMS[0]
    provider = _bmc_provider(tmp_path, sushy, {"m-1": system})
    async with RedfishClient() as redfish:
        await redfish.reset(sushy.system_url(system), Credentials(USERNAME, PASSWORD), "ForceOff")
    await _wait_power(sushy, system, PowerState.OFF)
    mid = (await provide(bmdb_conn, ["m-1"]))["m-1"]
    # Started just now: only the shortened first-heartbeat timeout makes it silent.
    await _start_silent_agent(bmdb_conn, mid, ago=0)

    await _run(bmdb_conn, Recoverer(provider, first_heartbeat_timeout=1.0), [mid])

    assert await events(bmdb_conn, mid, Process.SHEPHERD_RECOVERY) == [
        (WorkEvent.STARTED, ""),
        (WorkEvent.FINISHED, ""),
    ]
    assert await _tags(bmdb_conn, mid) == (False, False)
    await _wait_power(sushy, system, PowerState.ON)
    assert await backoffs(bmdb_conn, Process.SHEPHERD_RECOVERY) == {}


async def test_wrong_bmc_password_fails_that_machine_only(
    bmdb_conn: bmdb.Connection, sushy: Sushy, tmp_path: Path
) -> None:
    """A 401 from the BMC: that recovery fails with the cause and backs off, tags kept;
    the loop goes on to recover the next machine."""
    provider = _bmc_provider(
        tmp_path, sushy, {"bad": SYSTEMS[1], "good": SYSTEMS[2], "no-bmc": None}
    )
    ids = await provide(bmdb_conn, ["bad", "good", "no-bmc"])
    # "bad" went silent first, so the loop meets it first (oldest first).
    await _start_silent_agent(bmdb_conn, ids["bad"], ago=60)
    await _start_silent_agent(bmdb_conn, ids["good"], ago=0)
    await _start_silent_agent(bmdb_conn, ids["no-bmc"], ago=0)

    await _run(bmdb_conn, Recoverer(provider, first_heartbeat_timeout=1.0), list(ids.values()))

    bad = await events(bmdb_conn, ids["bad"], Process.SHEPHERD_RECOVERY)
    assert [e for e, _ in bad] == [WorkEvent.STARTED, WorkEvent.FAILED]
    url = sushy.system_url(SYSTEMS[1])
    assert bad[1][1].startswith(
        f"failed to reboot machine: BMC {url}: 401 Unauthorized: "
        "Incorrect username or password (user 'admin')"
    ), bad[1][1]
    assert "wrong" not in bad[1][1]
    assert await backoffs(bmdb_conn, Process.SHEPHERD_RECOVERY) == {
        ids["bad"]: (DEFAULT_BACKOFF.next(), bad[1][1])
    }
    assert await _tags(bmdb_conn, ids["bad"]) == (True, False)
    assert await _power(sushy, SYSTEMS[1]) == PowerState.ON  # never reset

    assert await events(bmdb_conn, ids["good"], Process.SHEPHERD_RECOVERY) == [
        (WorkEvent.STARTED, ""),
        (WorkEvent.FINISHED, ""),
    ]
    assert await _tags(bmdb_conn, ids["good"]) == (False, False)
    # A machine listed without a BMC in the same fleet: only its agent is restarted.
    assert await events(bmdb_conn, ids["no-bmc"], Process.SHEPHERD_RECOVERY) == [
        (WorkEvent.STARTED, ""),
        (WorkEvent.FINISHED, ""),
    ]
    assert await _tags(bmdb_conn, ids["no-bmc"]) == (False, False)
