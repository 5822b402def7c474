"""Bringing the static provider's machines into the BMDB."""

from __future__ import annotations

import bmdb
from bmdb import Provider, ProviderStatus, Queries
from bmdb.model import MachineProvided
from shepherd.providers import Machine
from shepherd.providers.static import StaticProvider
from shepherd.provisioner import SyncResult, sync_provided
from tests.shepherd.helpers import provide


async def _provided(conn: bmdb.Connection) -> dict[str, MachineProvided]:
    async def read(q: Queries) -> list[MachineProvided]:
        return await q.provided_by_provider(Provider.STATIC)

    return {p.provider_id: p for p in await conn.transact(read)}


async def test_adds_new_machines_refreshes_known_ones_and_is_idempotent(
    bmdb_conn: bmdb.Connection,
) -> None:
    # Known before: "old" (listed no more) and "moved" (listed with a new address).
    before = await provide(bmdb_conn, ["old", "moved"])
    provider = StaticProvider(
        [
            Machine("new-1", "192.0.2.1", location="fra1"),
            Machine("new-2", "192.0.2.2", port=2222),
            Machine("moved", "192.0.2.3", location="ams1"),
        ]
    )

    assert await sync_provided(bmdb_conn, provider) == SyncResult(["new-1", "new-2"], ["moved"])
    provided = await _provided(bmdb_conn)
    assert sorted(provided) == ["moved", "new-1", "new-2", "old"]
    assert (provided["new-1"].address, provided["new-1"].location) == ("192.0.2.1", "fra1")
    assert provided["new-1"].status == ProviderStatus.RUNNING
    assert provided["moved"].machine_id == before["moved"]
    assert (provided["moved"].address, provided["moved"].location) == ("192.0.2.3", "ams1")
    assert provided["old"].machine_id == before["old"]

    assert await sync_provided(bmdb_conn, provider) == SyncResult([], [])
    assert await _provided(bmdb_conn) == provided
