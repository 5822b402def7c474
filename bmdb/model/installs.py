"""OS installations: the request ``shepherd install`` stores, the agent's
report on it, and the agent's later check that it is still there.

`InstallQueries` writes and reads them; `INSTALL_STATE_SQL`,
`INSTALLATION_COLUMNS` and `installation_from_row` let the views
(`bmdb.overview`, `bmdb.metrics`) read an installation and its state the
way these statements write it. A request's generation never goes back;
a report counts only on the generation currently requested.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from bmdb.errors import InvalidArgument
from bmdb.model import channels
from bmdb.model import rows as records
from bmdb.model.base import QueriesBase
from bmdb.model.checks import as_uuid, check_generation, check_node_key, check_text


class InstallQueries(QueriesBase):
    """OS installation requests, the agents' reports on them and their checks."""

    async def set_os_installation_request(
        self,
        machine_id: uuid.UUID | str,
        generation: int,
        request: bytes,
        *,
        root_device: str | None = None,
        image_digest: str | None = None,
        node_address: str | None = None,
    ) -> bool:
        """Ask the machine's agent to install an OS: store the serialized
        OSInstallationRequest ``request`` of ``generation``, with the fields
        the views show beside it (the BMDB does not decode the bytes).

        Written only if ``generation`` is newer than the stored request's
        (or none is stored): a request's generation never goes back, so an
        agent that saw generation g never sees another request named g.
        Returns whether it was written; written, a notification on
        `channels.AGENT_REQUEST` names the machine when the transaction
        commits. `InvalidArgument` for a generation
        below 1 or texts PostgreSQL cannot store (NUL) or over
        `MAX_INSTALLATION_TEXT` characters. ``shepherd install`` calls this,
        with every field; a field left out shows as unknown in the views.
        """
        check_generation(generation)
        texts = {
            "root_device": root_device,
            "image_digest": image_digest,
            "node_address": node_address,
        }
        for name, value in texts.items():
            if value is not None:
                check_text(name, value)
        # Written, the agent callback server is told (`channels.AGENT_REQUEST`):
        # it answers the agent's held heartbeat with it at once.
        rows = await self.execute(
            f"""WITH w AS (
                   INSERT INTO machine_os_installation_request AS r
                       (machine_id, generation, os_installation_request_raw,
                        root_device, image_digest, node_address, requested_at)
                   VALUES (%s, %s, %s, %s, %s, %s, now())
                   ON CONFLICT (machine_id) DO UPDATE
                   SET generation = EXCLUDED.generation,
                       os_installation_request_raw = EXCLUDED.os_installation_request_raw,
                       root_device = EXCLUDED.root_device,
                       image_digest = EXCLUDED.image_digest,
                       node_address = EXCLUDED.node_address,
                       requested_at = EXCLUDED.requested_at
                   WHERE r.generation < EXCLUDED.generation
                   RETURNING machine_id)
               SELECT pg_notify('{channels.AGENT_REQUEST}', machine_id::text) FROM w""",
            (
                as_uuid(machine_id),
                generation,
                bytes(request),
                root_device,
                image_digest,
                node_address,
            ),
        )
        return bool(rows)

    async def os_installation(self, machine_id: uuid.UUID | str) -> records.OSInstallation | None:
        """The machine's installation request and the report on it, or None
        if it has no request."""
        rows = await self.execute(
            f"SELECT {INSTALLATION_COLUMNS} FROM machine_os_installation_request oq "
            "LEFT JOIN machine_os_installation_report orp ON orp.machine_id = oq.machine_id "
            "WHERE oq.machine_id = %s",
            (as_uuid(machine_id),),
        )
        return installation_from_row(rows[0]) if rows else None

    async def installation_target(
        self, machine_id: uuid.UUID | str
    ) -> records.InstallationTarget | None:
        """What deciding an installation of the machine needs: its provider
        address, stored hardware report, current installation and an
        operator's hold; None if there is no such machine."""
        rows = await self.execute(
            f"""SELECT m.machine_id, p.provider_address, hw.hardware_report_raw,
                       oq.machine_id IS NOT NULL, {INSTALLATION_COLUMNS},
                       (SELECT hd.held_by || ': ' || hd.reason FROM machine_hold hd
                        WHERE hd.machine_id = m.machine_id),
                       EXISTS (SELECT 1 FROM machine_decommission dc
                               WHERE dc.machine_id = m.machine_id)
                FROM machines m
                LEFT JOIN machine_provided p ON p.machine_id = m.machine_id
                LEFT JOIN machine_hardware_report hw ON hw.machine_id = m.machine_id
                LEFT JOIN machine_os_installation_request oq ON oq.machine_id = m.machine_id
                LEFT JOIN machine_os_installation_report orp ON orp.machine_id = m.machine_id
                WHERE m.machine_id = %s""",
            (as_uuid(machine_id),),
        )
        if not rows:
            return None
        r = rows[0]
        return records.InstallationTarget(
            machine_id=r[0],
            address=r[1],
            hardware_report=None if r[2] is None else bytes(r[2]),
            installation=installation_from_row(r[4 : 4 + INSTALLATION_WIDTH]) if r[3] else None,
            held=r[4 + INSTALLATION_WIDTH],
            decommissioned=r[5 + INSTALLATION_WIDTH],
        )

    async def set_os_installation_report(
        self, machine_id: uuid.UUID | str, generation: int, report: bytes
    ) -> None:
        """Store raw report bytes as the report on ``generation``, whatever is
        requested, and without the outcome: the views show such a report as
        not (yet) telling anything (installing). For tests and tools that
        need a report as it is; the agent callback server stores reports
        with `record_os_installation_report`. Notifies as that does."""
        await self.execute(
            f"""WITH w AS (
                   INSERT INTO machine_os_installation_report
                       (machine_id, generation, os_installation_report_raw) VALUES (%s, %s, %s)
                   ON CONFLICT (machine_id) DO UPDATE
                   SET generation = EXCLUDED.generation,
                       os_installation_report_raw = EXCLUDED.os_installation_report_raw,
                       success = NULL, cause = NULL, node_public_key = NULL,
                       reported_at = now(), checked_at = NULL, lost_cause = NULL
                   RETURNING machine_id)
               SELECT pg_notify('{channels.INSTALL_REPORT}', machine_id::text) FROM w""",
            (as_uuid(machine_id), int(generation), bytes(report)),
        )

    async def record_os_installation_report(
        self,
        machine_id: uuid.UUID | str,
        generation: int,
        raw: bytes,
        success: bool,
        cause: str | None,
        node_public_key: bytes | None,
    ) -> bool:
        """Store an agent's report on its OS installation; what the agent
        callback server calls when a heartbeat carries an OSInstallationReport.

        Stored only if ``generation`` is the one currently requested of the
        machine (a report on an older request, or on one never made, is
        dropped): returns whether it was stored (a notification on
        `channels.INSTALL_REPORT` then names the machine when the
        transaction commits). The request row is read
        with FOR SHARE, so a new request written at the same time either
        waits for this statement or makes it store nothing. A second report
        on the same generation replaces the first (an agent that restarted
        reports its recorded outcome again).

        ``raw`` is the serialized OSInstallationReport; ``success``,
        ``cause`` (required on failure, absent on success) and
        ``node_public_key`` (32 raw Ed25519 bytes, on success; may be None)
        are its fields, decoded by the caller, for the views.
        `InvalidArgument` (nothing written) for a combination that is not a
        report, a key that is not 32 bytes, or a cause PostgreSQL cannot
        store (NUL) or over `MAX_INSTALLATION_TEXT` characters: the caller
        cuts an agent's cause to that length first.
        """
        check_generation(generation)
        if success:
            if cause is not None:
                raise InvalidArgument("a successful installation report has no cause")
            if node_public_key is not None:
                check_node_key(node_public_key)
        else:
            if cause is None:
                raise InvalidArgument("a failed installation report needs a cause")
            if node_public_key is not None:
                raise InvalidArgument("a failed installation report has no node public key")
            check_text("cause", cause)
        # Stored, the approver is told (`channels.INSTALL_REPORT`).
        rows = await self.execute(
            f"""WITH w AS (
                   INSERT INTO machine_os_installation_report AS o
                       (machine_id, generation, os_installation_report_raw,
                        success, cause, node_public_key, reported_at)
                   SELECT r.machine_id, r.generation, %s, %s, %s, %s, now()
                   FROM machine_os_installation_request r
                   WHERE r.machine_id = %s AND r.generation = %s
                   FOR SHARE OF r
                   ON CONFLICT (machine_id) DO UPDATE
                   SET generation = EXCLUDED.generation,
                       os_installation_report_raw = EXCLUDED.os_installation_report_raw,
                       success = EXCLUDED.success,
                       cause = EXCLUDED.cause,
                       node_public_key = EXCLUDED.node_public_key,
                       reported_at = EXCLUDED.reported_at,
                       checked_at = NULL,
                       lost_cause = NULL
                   RETURNING machine_id)
               SELECT pg_notify('{channels.INSTALL_REPORT}', machine_id::text) FROM w""",
            (
                bytes(raw),
                bool(success),
                cause,
                None if node_public_key is None else bytes(node_public_key),
                as_uuid(machine_id),
                generation,
            ),
        )
        return bool(rows)

    async def record_installation_check(
        self,
        machine_id: uuid.UUID | str,
        generation: int,
        node_public_key: bytes | None,
        lost_cause: str | None,
    ) -> bool:
        """Store what an agent found of the generation it installed, reported
        unasked after the install's own report (migration 0010): still there
        (``node_public_key``, the node's key again) or gone (``lost_cause``,
        exactly one of the two). Stored only on the machine's current
        generation, and only if its report is a success of that same key
        (a check cannot turn a failed install into an installed one, nor
        name another node); returns whether it was stored. `InvalidArgument`
        for neither or both, a key that is not 32 bytes, a cause PostgreSQL
        cannot store or over `MAX_INSTALLATION_TEXT` characters."""
        check_generation(generation)
        if (node_public_key is None) == (lost_cause is None):
            raise InvalidArgument("an installation check is a node key or a cause, not both")
        if node_public_key is not None:
            check_node_key(node_public_key)
        if lost_cause is not None:
            check_text("cause", lost_cause)
        rows = await self.execute(
            """UPDATE machine_os_installation_report o
               SET checked_at = now(), lost_cause = %s
               FROM machine_os_installation_request r
               WHERE o.machine_id = %s AND o.generation = %s AND o.success
                 AND r.machine_id = o.machine_id AND r.generation = o.generation
                 AND (%s::bytea IS NULL OR o.node_public_key = %s::bytea)
               RETURNING 1""",
            (
                lost_cause,
                as_uuid(machine_id),
                generation,
                None if node_public_key is None else bytes(node_public_key),
                None if node_public_key is None else bytes(node_public_key),
            ),
        )
        return bool(rows)

    async def installed_machine_ids(self) -> list[uuid.UUID]:
        """Machines whose current installation succeeded with a node key and
        that are not (being) decommissioned, oldest first."""
        rows = await self.execute(
            """SELECT m.machine_id FROM machines m
               JOIN machine_os_installation_request oq ON oq.machine_id = m.machine_id
               JOIN machine_os_installation_report orp
                 ON orp.machine_id = oq.machine_id AND orp.generation = oq.generation
                AND orp.success AND orp.node_public_key IS NOT NULL
               WHERE NOT EXISTS (SELECT 1 FROM machine_decommission dc
                                 WHERE dc.machine_id = m.machine_id)
               ORDER BY m.machine_created_at, m.machine_id"""
        )
        return [r[0] for r in rows]


#: The installation state of a machine given its request oq and report orp
#: (NULL without a request); as `bmdb.model.OSInstallation.state` says.
INSTALL_STATE_SQL = """
    CASE WHEN oq.machine_id IS NULL THEN NULL
         WHEN orp.generation IS DISTINCT FROM oq.generation OR orp.success IS NULL
              THEN 'installing'
         WHEN orp.success AND orp.lost_cause IS NOT NULL THEN 'install-lost'
         WHEN orp.success THEN 'installed'
         ELSE 'install-failed' END
"""

#: The columns `installation_from_row` reads, of request ``oq`` and report ``orp``.
INSTALLATION_COLUMNS = """
    oq.generation, oq.root_device, oq.image_digest, oq.node_address, oq.requested_at,
    orp.generation, orp.success, orp.cause, orp.node_public_key, orp.reported_at,
    orp.lost_cause, orp.checked_at
"""
#: How many they are.
INSTALLATION_WIDTH = 12


def installation_from_row(r: Sequence[Any]) -> records.OSInstallation:
    """An `OSInstallation` from the `INSTALLATION_COLUMNS` of a row."""
    return records.OSInstallation(
        generation=r[0],
        root_device=r[1],
        image_digest=r[2],
        node_address=r[3],
        requested_at=r[4],
        report_generation=r[5],
        success=r[6],
        cause=r[7],
        node_public_key=None if r[8] is None else bytes(r[8]),
        reported_at=r[9],
        lost_cause=r[10],
        checked_at=r[11],
    )
