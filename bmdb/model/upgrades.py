"""Rolling upgrades (migration 0011): runs that upgrade machines phase by
phase, as shepherd/upgrade.py plans them and shepherd/upgrader.py takes
them.

`UpgradeQueries` holds the run (at most one unfinished), each machine's
turn (its source, `machines_for_upgrade`), the request its agent carries
(written, then activated), the agent's report, and the end of a machine's
upgrade and of the run.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from bmdb.errors import InvalidArgument
from bmdb.model import channels
from bmdb.model import rows as records
from bmdb.model.base import QueriesBase
from bmdb.model.checks import (
    MAX_INSTALLATION_TEXT,
    as_uuid,
    check_generation,
    check_limit,
    check_text,
)
from bmdb.model.claimable import ACTIVE_BACKOFF, LIVE_WORK, NOT_HELD
from bmdb.model.enums import Process

# The agent callback server is told that a machine's agent has an upgrade
# request to carry (`channels.AGENT_REQUEST`), as for an installation.
_NOTIFY_AGENT_REQUEST = f"SELECT pg_notify('{channels.AGENT_REQUEST}', %s::text)"


# The current installation report ``orp`` of machine upgrade ``mu``'s
# machine, if it succeeded: its node key names the machine's cluster node.
_NODE_OF_MU = """
    LEFT JOIN machine_os_installation_request oq ON oq.machine_id = mu.machine_id
    LEFT JOIN machine_os_installation_report orp
      ON orp.machine_id = oq.machine_id AND orp.generation = oq.generation
     AND orp.success
"""


class UpgradeQueries(QueriesBase):
    """Rolling upgrade runs and the upgrade of each of their machines."""

    async def running_upgrade_run(self) -> records.UpgradeRun | None:
        """The run not finished yet, if any (there is at most one); locked
        FOR UPDATE, so that deciding against it (a new run, a machine's turn)
        is one at a time."""
        rows = await self.execute(
            f"SELECT {_RUN_COLUMNS} FROM upgrade_run r WHERE r.finished_at IS NULL FOR UPDATE"
        )
        return _upgrade_run(rows[0]) if rows else None

    async def create_upgrade_run(
        self,
        *,
        image_digest: str,
        os_image: bytes,
        max_unavailable: int,
        health_timeout: int,
        requested_by: str,
        machines: Sequence[records.UpgradePlanEntry],
    ) -> records.UpgradeRun:
        """Start a run of ``machines`` (all pending). `InvalidArgument` (nothing
        written) while another run is not finished, for no machines, a machine
        listed twice, or values out of range (the table's CHECKs say which)."""
        if not machines:
            raise InvalidArgument("an upgrade run needs at least one machine")
        if len({m.machine_id for m in machines}) != len(machines):
            raise InvalidArgument("a machine is listed twice")
        check_text("requested by", requested_by)
        running = await self.running_upgrade_run()
        if running is not None:
            raise InvalidArgument(
                f"upgrade run {running.run_id} (to {running.image_digest}) is not finished: "
                "one run at a time"
            )
        rows = await self.execute(
            f"""INSERT INTO upgrade_run AS r (image_digest, os_image_raw, max_unavailable,
                                         health_timeout_seconds, requested_by)
                VALUES (%s, %s, %s, %s, %s) RETURNING {_RUN_COLUMNS}""",
            (image_digest, bytes(os_image), max_unavailable, health_timeout, requested_by),
        )
        run = _upgrade_run(rows[0])
        await self.execute(
            """INSERT INTO machine_upgrade
                   (run_id, machine_id, phase, position, root_device, from_digest)
               SELECT %(run)s, * FROM unnest(%(ids)s::uuid[], %(phases)s::smallint[],
                                             %(positions)s::integer[], %(devices)s::text[],
                                             %(digests)s::text[])""",
            {
                "run": run.run_id,
                "ids": [m.machine_id for m in machines],
                "phases": [m.phase for m in machines],
                "positions": [m.position for m in machines],
                "devices": [m.root_device for m in machines],
                "digests": [m.from_digest for m in machines],
            },
        )
        return run

    async def upgrade_runs(self, limit: int = 20) -> list[records.UpgradeRun]:
        """The newest runs, newest first."""
        rows = await self.execute(
            f"SELECT {_RUN_COLUMNS} FROM upgrade_run r ORDER BY r.requested_at DESC LIMIT %s",
            (check_limit(limit),),
        )
        return [_upgrade_run(r) for r in rows]

    async def upgrade_run(self, run_id: uuid.UUID | str) -> records.UpgradeRun | None:
        rows = await self.execute(
            f"SELECT {_RUN_COLUMNS} FROM upgrade_run r WHERE r.run_id = %s", (as_uuid(run_id),)
        )
        return _upgrade_run(rows[0]) if rows else None

    async def upgrade_run_age(self, run_id: uuid.UUID | str) -> float | None:
        """Seconds since the run was made, by the database's clock (None: no such run)."""
        rows = await self.execute(
            """SELECT extract(epoch FROM now() - requested_at)::float8
               FROM upgrade_run WHERE run_id = %s""",
            (as_uuid(run_id),),
        )
        return float(rows[0][0]) if rows else None

    async def upgrade_machines(
        self, run_id: uuid.UUID | str
    ) -> list[tuple[records.MachineUpgrade, bytes | None]]:
        """The machines of a run in their order, each with the node key of its
        current successful installation report."""
        rows = await self.execute(
            f"""SELECT {_MACHINE_UPGRADE_COLUMNS}, orp.node_public_key
                FROM machine_upgrade mu
                {_NODE_OF_MU}
                WHERE mu.run_id = %s
                ORDER BY mu.phase, mu.position, mu.machine_id""",
            (as_uuid(run_id),),
        )
        return [(_machine_upgrade(r), None if r[-1] is None else bytes(r[-1])) for r in rows]

    async def machine_upgrade(
        self, run_id: uuid.UUID | str, machine_id: uuid.UUID | str
    ) -> tuple[records.MachineUpgrade, bytes | None, float | None] | None:
        """One machine of a run: its row, its node key (as `upgrade_machines`),
        and the seconds since its upgrade was requested, by the database's
        clock (None while pending)."""
        rows = await self.execute(
            f"""SELECT {_MACHINE_UPGRADE_COLUMNS}, orp.node_public_key,
                       extract(epoch FROM now() - mu.requested_at)::float8
                FROM machine_upgrade mu
                {_NODE_OF_MU}
                WHERE mu.run_id = %s AND mu.machine_id = %s""",
            (as_uuid(run_id), as_uuid(machine_id)),
        )
        if not rows:
            return None
        r = rows[0]
        return _machine_upgrade(r[:-2]), None if r[-2] is None else bytes(r[-2]), r[-1]

    async def latest_upgrades(self) -> dict[uuid.UUID, records.MachineUpgrade]:
        """Each machine's row of the newest run that lists it (for the views)."""
        rows = await self.execute(
            f"""SELECT DISTINCT ON (mu.machine_id) {_MACHINE_UPGRADE_COLUMNS}
                FROM machine_upgrade mu JOIN upgrade_run r ON r.run_id = mu.run_id
                ORDER BY mu.machine_id, r.requested_at DESC"""
        )
        return {row.machine_id: row for row in map(_machine_upgrade, rows)}

    async def machines_for_upgrade(self, limit: int) -> list[records.UpgradeTarget]:
        """Machines of the running run whose turn it may be: those requested
        already (a worker died while upgrading them: taken up again first),
        then pending ones of the lowest phase that has any not done, while
        fewer than the run allows are requested (phase 0: max_unavailable;
        consensus phases: one); without live upgrade work, upgrade backoff
        or a hold. The upgrader checks the cluster's own view before it
        requests one (the order here is what it last saw)."""
        busy = [Process.SHEPHERD_UPGRADE]
        rows = await self.execute(
            f"""SELECT {_RUN_COLUMNS}, {_MACHINE_UPGRADE_COLUMNS}, orp.node_public_key
                FROM machine_upgrade mu
                JOIN upgrade_run r ON r.run_id = mu.run_id AND r.finished_at IS NULL
                JOIN machines m ON m.machine_id = mu.machine_id
                {_NODE_OF_MU}
                WHERE mu.state IN ('pending', 'requested')
                  AND NOT {LIVE_WORK}
                  AND NOT {ACTIVE_BACKOFF}
                  AND {NOT_HELD}
                  AND (mu.state = 'requested' OR (
                      NOT EXISTS (SELECT 1 FROM machine_upgrade o
                                  WHERE o.run_id = mu.run_id AND o.phase < mu.phase
                                    AND o.state IN ('pending', 'requested'))
                      AND (SELECT count(*) FROM machine_upgrade o
                           WHERE o.run_id = mu.run_id AND o.state = 'requested')
                          < CASE WHEN mu.phase = 0 THEN r.max_unavailable ELSE 1 END))
                ORDER BY mu.state = 'requested' DESC, mu.phase, mu.position, mu.machine_id
                LIMIT %(limit)s {"FOR UPDATE OF m SKIP LOCKED" if self.locking else ""}""",
            {"limit": check_limit(limit), "busy": busy, "process": Process.SHEPHERD_UPGRADE},
        )
        n = len(_RUN_FIELDS)
        return [
            records.UpgradeTarget(
                run=_upgrade_run(r[:n]),
                machine=_machine_upgrade(r[n:-1]),
                node_public_key=None if r[-1] is None else bytes(r[-1]),
            )
            for r in rows
        ]

    async def next_upgrade_generation(self, machine_id: uuid.UUID | str) -> int:
        """One more than the machine's last upgrade generation (1 for its first)."""
        rows = await self.execute(
            "SELECT coalesce(max(generation), 0) + 1 FROM machine_upgrade WHERE machine_id = %s",
            (as_uuid(machine_id),),
        )
        return int(rows[0][0])

    async def write_upgrade(
        self,
        run_id: uuid.UUID | str,
        machine_id: uuid.UUID | str,
        generation: int,
        request: bytes,
    ) -> bool:
        """Ask the pending machine of the running run to write the new image
        to its inactive slot: its agent is carried ``request`` (of
        ``generation``, not activating) while the run runs; the machine stays
        pending (it takes no node down). Whether it was pending without one."""
        rows = await self.execute(
            """UPDATE machine_upgrade mu
               SET generation = %s, request_raw = %s, updated_at = now()
               FROM upgrade_run r
               WHERE r.run_id = mu.run_id AND r.finished_at IS NULL
                 AND mu.run_id = %s AND mu.machine_id = %s
                 AND mu.state = 'pending' AND mu.generation IS NULL
               RETURNING 1""",
            (generation, bytes(request), as_uuid(run_id), as_uuid(machine_id)),
        )
        if rows:
            await self.execute(_NOTIFY_AGENT_REQUEST, (str(as_uuid(machine_id)),))
        return bool(rows)

    async def request_upgrade(
        self,
        run_id: uuid.UUID | str,
        machine_id: uuid.UUID | str,
        generation: int,
        request: bytes,
    ) -> str | None:
        """Make the pending machine's upgrade requested (its agent is carried
        ``request`` of ``generation`` from now on); None if done, else why not:
        the run is finished, the machine not pending, or the run has as many
        requested as it allows (its row locked first: one decision at a time)."""
        run = await self.running_upgrade_run()
        if run is None or run.run_id != as_uuid(run_id):
            return "the run is finished"
        rows = await self.execute(
            """SELECT (SELECT phase FROM machine_upgrade
                       WHERE run_id = %(run)s AND machine_id = %(machine)s AND state = 'pending'),
                      count(*) FILTER (WHERE state = 'requested')
               FROM machine_upgrade WHERE run_id = %(run)s""",
            {"run": run.run_id, "machine": as_uuid(machine_id)},
        )
        phase, requested = rows[0]
        if phase is None:
            return "the machine is not pending in this run"
        allowed = run.max_unavailable if phase == 0 else 1
        if requested >= allowed:
            return f"{requested} machine(s) of the run are being upgraded (at most {allowed})"
        await self.execute(
            """UPDATE machine_upgrade
               SET state = 'requested', generation = %s, request_raw = %s, requested_at = now(),
                   detail = NULL, updated_at = now()
               WHERE run_id = %s AND machine_id = %s""",
            (generation, bytes(request), run.run_id, as_uuid(machine_id)),
        )
        await self.execute(_NOTIFY_AGENT_REQUEST, (str(as_uuid(machine_id)),))
        return None

    async def set_upgrade_order(
        self, run_id: uuid.UUID | str, order: Sequence[tuple[uuid.UUID, int, int]]
    ) -> None:
        """Store each machine's (phase, position), as the cluster now says."""
        await self.execute(
            """UPDATE machine_upgrade mu SET phase = o.phase, position = o.position
               FROM unnest(%(ids)s::uuid[], %(phases)s::smallint[], %(positions)s::integer[])
                    AS o(machine_id, phase, position)
               WHERE mu.run_id = %(run)s AND mu.machine_id = o.machine_id""",
            {
                "run": as_uuid(run_id),
                "ids": [o[0] for o in order],
                "phases": [o[1] for o in order],
                "positions": [o[2] for o in order],
            },
        )

    async def note_upgrade(
        self, run_id: uuid.UUID | str, machine_id: uuid.UUID | str, detail: str
    ) -> None:
        """Say why the machine's upgrade waits, or where it is (for the views)."""
        check_text("detail", detail)
        await self.execute(
            """UPDATE machine_upgrade SET detail = %s, updated_at = now()
               WHERE run_id = %s AND machine_id = %s""",
            (detail, as_uuid(run_id), as_uuid(machine_id)),
        )

    async def end_machine_upgrade(
        self,
        run_id: uuid.UUID | str,
        machine_id: uuid.UUID | str,
        state: records.UpgradeState,
        detail: str,
        *,
        slot: str | None = None,
        running_digest: str | None = None,
    ) -> records.UpgradeRun | None:
        """End the machine's upgrade in ``state`` (a final one). Not upgraded:
        the run stops with the cause. Upgraded and the last: the run is
        finished. Returns the run as it is after."""
        if not records.UpgradeState(state).final:
            raise InvalidArgument(f"{state} is not a final upgrade state")
        check_text("detail", detail)
        run, machine = as_uuid(run_id), as_uuid(machine_id)
        await self.execute(
            """UPDATE machine_upgrade
               SET state = %s, detail = %s, slot = %s, running_digest = %s, updated_at = now()
               WHERE run_id = %s AND machine_id = %s AND state IN ('pending', 'requested')""",
            (str(state), detail, slot, running_digest, run, machine),
        )
        if state is records.UpgradeState.UPGRADED:
            await self.execute(
                """UPDATE upgrade_run SET finished_at = now()
                   WHERE run_id = %(run)s AND finished_at IS NULL
                     AND NOT EXISTS (SELECT 1 FROM machine_upgrade WHERE run_id = %(run)s
                                     AND state IN ('pending', 'requested'))""",
                {"run": run},
            )
        else:
            cause = f"machine {machine} {state}: {detail}"[:MAX_INSTALLATION_TEXT]
            await self.execute(
                """UPDATE upgrade_run SET finished_at = now(), stop_cause = %s
                   WHERE run_id = %s AND finished_at IS NULL""",
                (cause, run),
            )
        return await self.upgrade_run(run)

    async def stop_upgrade_run(self, run_id: uuid.UUID | str, cause: str) -> bool:
        """Stop a running run (an operator's stop): no machine is requested from
        now on; a machine being upgraded ends as its agent and node make it.
        Whether it was running."""
        check_text("cause", cause)
        rows = await self.execute(
            """UPDATE upgrade_run SET finished_at = now(), stop_cause = %s
               WHERE run_id = %s AND finished_at IS NULL RETURNING 1""",
            (cause, as_uuid(run_id)),
        )
        return bool(rows)

    async def record_upgrade_report(
        self,
        machine_id: uuid.UUID | str,
        generation: int,
        state: str,
        detail: str,
        slot: str,
    ) -> bool:
        """Store an agent's UpgradeReport on the machine's upgrade of
        ``generation``, requested or (its write) pending; else nothing: False."""
        check_generation(generation)
        for name, value in (("state", state), ("detail", detail), ("slot", slot)):
            check_text(name, value)
        rows = await self.execute(
            """UPDATE machine_upgrade
               SET agent_state = %s, agent_detail = %s, agent_slot = %s,
                   agent_reported_at = now(), updated_at = now()
               WHERE machine_id = %s AND state IN ('pending', 'requested') AND generation = %s
               RETURNING 1""",
            (state, detail, slot, as_uuid(machine_id), generation),
        )
        return bool(rows)


_RUN_FIELDS = (
    "run_id", "image_digest", "os_image_raw", "max_unavailable", "health_timeout_seconds",
    "requested_by", "requested_at", "finished_at", "stop_cause",
)  # fmt: skip
#: The columns `_upgrade_run` reads, of run ``r``.
_RUN_COLUMNS = ", ".join(f"r.{name}" for name in _RUN_FIELDS)

_MACHINE_UPGRADE_FIELDS = (
    "run_id", "machine_id", "state", "phase", "position", "root_device", "from_digest",
    "generation", "requested_at", "slot", "running_digest", "detail", "agent_state",
    "agent_detail", "agent_slot", "agent_reported_at", "updated_at",
)  # fmt: skip
#: The columns `_machine_upgrade` reads, of machine upgrade ``mu``.
_MACHINE_UPGRADE_COLUMNS = ", ".join(f"mu.{name}" for name in _MACHINE_UPGRADE_FIELDS)


def _upgrade_run(r: Sequence[Any]) -> records.UpgradeRun:
    return records.UpgradeRun(
        run_id=r[0],
        image_digest=r[1],
        os_image=bytes(r[2]),
        max_unavailable=r[3],
        health_timeout=r[4],
        requested_by=r[5],
        requested_at=r[6],
        finished_at=r[7],
        stop_cause=r[8],
    )


def _machine_upgrade(r: Sequence[Any]) -> records.MachineUpgrade:
    return records.MachineUpgrade(
        run_id=r[0],
        machine_id=r[1],
        state=records.UpgradeState(r[2]),
        phase=r[3],
        position=r[4],
        root_device=r[5],
        from_digest=r[6],
        generation=r[7],
        requested_at=r[8],
        slot=r[9],
        running_digest=r[10],
        detail=r[11],
        agent_state=r[12],
        agent_detail=r[13],
        agent_slot=r[14],
        agent_reported_at=r[15],
        updated_at=r[16],
    )
