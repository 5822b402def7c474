"""Decommissioning: a machine's way from an operator's request
(`bmdb.actions`) to a tombstone, as shepherd/decommissioner.py takes it.

`DecommissionQueries` holds its source (`machines_for_decommission`), and
records each step: the node's removal from its cluster, the agent's wipe,
the provider's release, and the tombstone, kept with its history and
offered to no process.
"""

from __future__ import annotations

import uuid

from bmdb.errors import InvalidArgument
from bmdb.model import rows as records
from bmdb.model.agents import AgentQueries
from bmdb.model.checks import as_uuid, check_limit, check_text
from bmdb.model.claimable import ACTIVE_BACKOFF, AGENT_PROCESSES, LIVE_WORK, NOT_PENDING
from bmdb.model.enums import Process, Provider
from bmdb.model.machines import PROVIDED_COLUMNS, provided_from_row

#: The node id (`rows.node_id`) of the installation report ``orp``'s key.
_NODE_ID_OF_REPORT = (
    f"('{records.NODE_ID_PREFIX}' || encode(substring(orp.node_public_key FROM 1 FOR 16), 'hex'))"
)


class DecommissionQueries(AgentQueries):
    """A machine's decommission, from its source to its tombstone (which
    forgets the agent: hence an `AgentQueries`)."""

    async def machines_for_decommission(self, limit: int) -> list[records.DecommissionTarget]:
        """Machines an operator asked to decommission, not done yet, without
        live work of the agent processes or the decommissioner, backoff of
        the decommissioner or a hold; oldest request first (locking what it
        returns inside a work source)."""
        busy = [*AGENT_PROCESSES, Process.SHEPHERD_DECOMMISSION]
        rows = await self.execute(
            f"""SELECT {PROVIDED_COLUMNS}, k.public_key, dc.wiped_at IS NOT NULL,
                       dc.released_at IS NOT NULL, orp.node_public_key,
                       dc.node_id IS NOT DISTINCT FROM {_NODE_ID_OF_REPORT}
                FROM machines m
                JOIN machine_decommission dc ON dc.machine_id = m.machine_id
                LEFT JOIN machine_provided p ON p.machine_id = m.machine_id
                LEFT JOIN machine_ssh_host_key k ON k.machine_id = m.machine_id
                LEFT JOIN machine_os_installation_request oq ON oq.machine_id = m.machine_id
                LEFT JOIN machine_os_installation_report orp
                  ON orp.machine_id = m.machine_id AND orp.generation = oq.generation
                 AND orp.success
                WHERE dc.decommissioned_at IS NULL
                  AND NOT {LIVE_WORK}
                  AND NOT {ACTIVE_BACKOFF}
                  AND NOT EXISTS (SELECT 1 FROM machine_hold hd WHERE hd.machine_id = m.machine_id)
                  AND {NOT_PENDING}
                ORDER BY dc.requested_at, m.machine_id
                LIMIT %(limit)s {"FOR UPDATE OF m SKIP LOCKED" if self.locking else ""}""",
            {"limit": check_limit(limit), "busy": busy, "process": Process.SHEPHERD_DECOMMISSION},
        )
        return [
            records.DecommissionTarget(
                machine_id=r[0],
                provided=provided_from_row(r[:6]) if r[1] is not None else None,
                host_key=None if r[6] is None else bytes(r[6]),
                wiped=r[7],
                released=r[8],
                node_public_key=None if r[9] is None else bytes(r[9]),
                node_removed=r[10],
            )
            for r in rows
        ]

    async def record_node_removal(
        self, machine_id: uuid.UUID | str, node_id: str, detail: str
    ) -> None:
        """Store that the cluster node ``node_id`` the machine ran was removed
        from its cluster (``detail``: what changed). Usually before its wipe;
        after it for a node whose install report came in meanwhile (see
        `unremoved_node_key`), whose removal is then added to the first."""
        check_text("node id", node_id)
        check_text("node removal", detail)
        await self.execute(
            """UPDATE machine_decommission
               SET node_id = %(node)s, node_removed_at = now(),
                   node_removal = CASE WHEN node_removal IS NULL THEN %(detail)s
                                       ELSE node_removal || '; then ' || %(detail)s END
               WHERE machine_id = %(machine)s AND decommissioned_at IS NULL""",
            {"node": node_id, "detail": detail, "machine": as_uuid(machine_id)},
        )

    async def unremoved_node_key(self, machine_id: uuid.UUID | str) -> bytes | None:
        """The node key of the machine's current successful installation
        report, unless that node's removal from its cluster is recorded.

        Read by the decommissioner once the machine is wiped: a report the
        agent stored after the decommissioner's source had read none names a
        node the cluster still lists (dead now)."""
        rows = await self.execute(
            f"""SELECT orp.node_public_key
                FROM machine_decommission dc
                JOIN machine_os_installation_request oq ON oq.machine_id = dc.machine_id
                JOIN machine_os_installation_report orp
                  ON orp.machine_id = oq.machine_id AND orp.generation = oq.generation
                 AND orp.success AND orp.node_public_key IS NOT NULL
                WHERE dc.machine_id = %s
                  AND dc.node_id IS DISTINCT FROM {_NODE_ID_OF_REPORT}""",
            (as_uuid(machine_id),),
        )
        return bytes(rows[0][0]) if rows else None

    async def record_wipe(self, machine_id: uuid.UUID | str, report: str) -> None:
        """Store the agent's wipe report on a machine being decommissioned."""
        check_text("wipe report", report)
        await self.execute(
            """UPDATE machine_decommission SET wiped_at = now(), wipe_report = %s
               WHERE machine_id = %s AND decommissioned_at IS NULL""",
            (report, as_uuid(machine_id)),
        )

    async def record_release(self, machine_id: uuid.UUID | str, detail: str) -> None:
        """Store the provider's line on releasing a wiped machine."""
        check_text("release detail", detail)
        await self.execute(
            """UPDATE machine_decommission SET released_at = now(), release_detail = %s
               WHERE machine_id = %s AND decommissioned_at IS NULL""",
            (detail, as_uuid(machine_id)),
        )

    async def tombstone(self, machine_id: uuid.UUID | str) -> None:
        """Mark a wiped and released machine decommissioned: a tombstone, kept
        with its history, offered to no process. Its agent tags go (the
        agent's key was wiped). `InvalidArgument` unless wiped and released."""
        mid = as_uuid(machine_id)
        rows = await self.execute(
            """UPDATE machine_decommission SET decommissioned_at = now()
               WHERE machine_id = %s AND released_at IS NOT NULL AND decommissioned_at IS NULL
               RETURNING 1""",
            (mid,),
        )
        if not rows:
            raise InvalidArgument(f"machine {mid} is not wiped and released, or done already")
        await self.delete_agent_started(mid)
        await self.delete_agent_heartbeat(mid)

    async def decommissioned_provider_ids(self, provider: Provider | str) -> set[str]:
        """Provider ids of ``provider``'s machines being or done decommissioned
        (the provisioner neither counts nor adds them again)."""
        rows = await self.execute(
            """SELECT p.provider_id FROM machine_provided p
               JOIN machine_decommission dc ON dc.machine_id = p.machine_id
               WHERE p.provider = %s""",
            (Provider.parse(provider),),
        )
        return {r[0] for r in rows}
