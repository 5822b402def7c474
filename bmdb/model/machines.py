"""Machines and their provider tags: what the provisioner writes, and the
SSH host key the initializer trusts.

`MachineQueries` creates machines, tags each as supplied by a provider
(``machine_provided``), refreshes what the provider says of it, and keeps
the host key first seen on it. `PROVIDED_COLUMNS` and `provided_from_row`
read a provider tag, for every module whose rows carry one.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from bmdb.errors import InvalidArgument
from bmdb.model import rows as records
from bmdb.model.base import QueriesBase
from bmdb.model.checks import as_uuid
from bmdb.model.enums import Provider, ProviderStatus

PROVIDED_COLUMNS = """
    p.machine_id, p.provider, p.provider_id, p.provider_address, p.provider_location,
    p.provider_status
"""


class MachineQueries(QueriesBase):
    """Machines, their provider tags and their trusted SSH host keys."""

    async def new_machine(self) -> uuid.UUID:
        """Create a machine without tags and return its id."""
        rows = await self.execute("INSERT INTO machines DEFAULT VALUES RETURNING machine_id")
        machine_id: uuid.UUID = rows[0][0]
        return machine_id

    async def add_provided(
        self,
        machine_id: uuid.UUID | str,
        provider: Provider | str,
        provider_id: str,
        address: str | None = None,
        location: str | None = None,
        status: ProviderStatus | str = ProviderStatus.UNKNOWN,
    ) -> None:
        """Tag a machine as supplied by ``provider`` under ``provider_id``.

        Raises `InvalidArgument` for an unknown machine, an empty provider id,
        or a provider id already used by another machine of that provider.
        """
        if not provider_id:
            raise InvalidArgument("provider_id must not be empty")
        await self.execute(
            """INSERT INTO machine_provided (machine_id, provider, provider_id, provider_address,
                   provider_location, provider_status)
               VALUES (%s, %s, %s, %s, %s, %s)""",
            (
                as_uuid(machine_id),
                Provider.parse(provider),
                provider_id,
                address,
                location,
                ProviderStatus.parse(status),
            ),
        )

    async def update_provided(
        self,
        machine_id: uuid.UUID | str,
        address: str | None,
        location: str | None,
        status: ProviderStatus | str,
    ) -> bool:
        """Refresh what the provider says about a machine. Returns False if the
        machine has no provider tag."""
        rows = await self.execute(
            """UPDATE machine_provided
               SET provider_address = %s, provider_location = %s, provider_status = %s
               WHERE machine_id = %s RETURNING 1""",
            (address, location, ProviderStatus.parse(status), as_uuid(machine_id)),
        )
        return bool(rows)

    async def provided_by_provider(self, provider: Provider | str) -> list[records.MachineProvided]:
        """Every machine of ``provider``, by provider id."""
        rows = await self.execute(
            f"SELECT {PROVIDED_COLUMNS} FROM machine_provided p WHERE p.provider = %s"
            " ORDER BY p.provider_id",
            (Provider.parse(provider),),
        )
        return [provided_from_row(r) for r in rows]

    async def get_ssh_host_key(self, machine_id: uuid.UUID | str) -> bytes | None:
        """The SSH host key first seen on the machine, if any."""
        rows = await self.execute(
            "SELECT public_key FROM machine_ssh_host_key WHERE machine_id = %s",
            (as_uuid(machine_id),),
        )
        return bytes(rows[0][0]) if rows else None

    async def set_ssh_host_key(self, machine_id: uuid.UUID | str, key: bytes) -> None:
        """Record (or replace) the machine's trusted SSH host key."""
        if not key:
            raise InvalidArgument("key must not be empty")
        await self.execute(
            """INSERT INTO machine_ssh_host_key (machine_id, public_key) VALUES (%s, %s)
               ON CONFLICT (machine_id) DO UPDATE
               SET public_key = EXCLUDED.public_key, first_seen = now()""",
            (as_uuid(machine_id), bytes(key)),
        )


def provided_from_row(r: Sequence[Any]) -> records.MachineProvided:
    return records.MachineProvided(
        machine_id=r[0],
        provider=Provider(r[1]),
        provider_id=r[2],
        address=r[3],
        location=r[4],
        status=ProviderStatus(r[5]),
    )
