"""Bringing a provider's machines into the BMDB.

This is the part of the provisioner that a fleet you already own needs: the
static provider's list is the truth, and the BMDB gets a ``machine_provided``
tag for every listed machine it does not know yet (matched by provider id),
and fresh address and location for those it knows. Machines that disappeared
from the list are left alone: forgetting a machine is an operator's decision,
not something a typo in a file should do.

(Creating machines at a provider, as with Equinix reservations, is not here.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import bmdb
from bmdb import ProviderStatus, Queries
from shepherd.providers import Provider

logger = logging.getLogger("shepherd.provisioner")


@dataclass(frozen=True)
class SyncResult:
    """Provider ids added to and refreshed in the BMDB by :func:`sync_provided`."""

    added: list[str]
    updated: list[str]


async def sync_provided(conn: bmdb.Connection, provider: Provider) -> SyncResult:
    """Make the BMDB's ``machine_provided`` tags match ``provider``'s list.

    One transaction: either every listed machine is recorded or none is.
    Idempotent; running it again without changes updates nothing. Raises
    :class:`bmdb.errors.BMDBError` subclasses (e.g. ``InvalidArgument`` if
    the provider's type is unknown to the BMDB) and the provider's errors.
    """
    machines = await provider.list_machines()

    async def sync(q: Queries) -> SyncResult:
        known = {p.provider_id: p for p in await q.provided_by_provider(provider.type)}
        added: list[str] = []
        updated: list[str] = []
        for machine in machines:
            current = known.get(machine.id)
            if current is None:
                machine_id = await q.new_machine()
                await q.add_provided(
                    machine_id,
                    provider.type,
                    machine.id,
                    machine.address,
                    machine.location,
                    ProviderStatus.RUNNING,
                )
                added.append(machine.id)
            elif (current.address, current.location) != (machine.address, machine.location):
                await q.update_provided(
                    current.machine_id, machine.address, machine.location, current.status
                )
                updated.append(machine.id)
        return SyncResult(added, updated)

    result = await conn.transact(sync)
    logger.info(
        "%s provider: %d machine(s) listed, %d added to the BMDB, %d updated",
        provider.type,
        len(machines),
        len(result.added),
        len(result.updated),
    )
    return result
