"""The updater: BMDB records follow the provider (local Equinix API, sushy-tools BMCs)."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import pytest

import bmdb
from bmdb import Provider, ProviderStatus, Queries
from bmdb.model import MachineProvided
from shepherd.providers import Machine
from shepherd.providers.equinix.client import EquinixClient, RetryPolicy
from shepherd.providers.equinix.localserver import Fault, LocalEquinix
from shepherd.providers.equinix.provider import EquinixConfig, EquinixProvider
from shepherd.providers.redfish import BMCCredentials, Credentials, RedfishClient
from shepherd.providers.static import StaticProvider
from shepherd.provisioner import Provisioner, ProvisionerConfig
from shepherd.rate_limit import Rate
from shepherd.ssh_key import SSHKey
from shepherd.updater import Updater, UpdaterConfig
from tests.fixtures.sushy import PASSWORD, SYSTEMS, USERNAME, Sushy


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _rows(conn: bmdb.Connection, provider: str) -> dict[str, MachineProvided]:
    async def read(q: Queries) -> list[MachineProvided]:
        return await q.provided_by_provider(provider)

    return {p.provider_id: p for p in await conn.transact(read)}


@pytest.fixture
async def eq_client(equinix: LocalEquinix) -> AsyncIterator[EquinixClient]:
    retry = RetryPolicy(initial=0.01, maximum=0.05, attempts=3)
    async with EquinixClient(equinix.token, base_url=equinix.url, retry=retry) as client:
        yield client


async def test_equinix_status_address_and_disappearance_are_recorded_in_batches(
    bmdb_conn: bmdb.Connection, equinix: LocalEquinix, eq_client: EquinixClient
) -> None:
    equinix.add_reservations(7)
    equinix.provisioning_delay = 3600
    config = EquinixConfig(equinix.project_id, "shepherd-test", "shepherd-test-")
    provider = EquinixProvider(eq_client, config, SSHKey.generate().authorized_key)
    unlimited = Rate(0.0, 1)
    provisioner = Provisioner(
        provider, ProvisionerConfig(creation_rate=unlimited, reconciler_rate=unlimited)
    )
    created = (await provisioner.reconcile(bmdb_conn)).created
    rows = await _rows(bmdb_conn, Provider.EQUINIX)
    assert {r.status for r in rows.values()} == {ProviderStatus.PROVISIONING}
    clock = Clock()
    updater = Updater(provider, UpdaterConfig(batch_size=3), clock=clock)

    assert (await updater.update_once(bmdb_conn)).updated == []  # nothing changed

    for device in equinix.devices.values():
        device["state"] = "active"
    moved, gone, broken = created[:3]
    equinix.devices[moved]["ip_addresses"][0]["address"] = "203.0.113.9"
    equinix.delete_device(gone)
    equinix.inject("GET", f"/devices/{broken}", Fault(status=500), times=3)

    result = await updater.update_once(bmdb_conn)

    assert sorted(result.updated) == sorted(set(created) - {broken})
    assert (
        list(result.failed) == [broken] and "gave up after 3 attempts: 500" in result.failed[broken]
    )
    rows = await _rows(bmdb_conn, Provider.EQUINIX)
    assert rows[moved].address == "203.0.113.9"
    assert rows[gone].status == ProviderStatus.MISSING  # recorded, not deleted
    assert rows[broken].status == ProviderStatus.PROVISIONING
    assert {rows[p].status for p in set(created) - {gone, broken}} == {ProviderStatus.RUNNING}

    # The broken one backs off; the others, just changed, are checked again.
    again = await updater.update_once(bmdb_conn)
    assert (again.skipped, again.checked, again.failed, again.updated) == (1, 6, {}, [])
    clock.now += 61
    healed = await updater.update_once(bmdb_conn)
    # The five Running ones are settled now: asked again only after 30 minutes.
    # ("gone" is Missing, never settled.)
    assert (healed.updated, healed.skipped, healed.checked) == ([broken], 5, 2)
    clock.now += 1800
    assert (await updater.update_once(bmdb_conn)).checked == 7


async def test_bmc_power_state_is_recorded_and_bmc_failures_back_off(
    bmdb_conn: bmdb.Connection, sushy: Sushy
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    good = Credentials(USERNAME, PASSWORD)
    provider = StaticProvider(
        [
            Machine("good", "192.0.2.1", bmc=sushy.system_url(SYSTEMS[0])),
            Machine("wrong-password", "192.0.2.2", bmc=sushy.system_url(SYSTEMS[1])),
            Machine(
                "unreachable",
                "192.0.2.3",
                bmc=f"http://127.0.0.1:{closed_port}/redfish/v1/Systems/1",
            ),
            Machine("no-bmc", "192.0.2.4"),
        ],
        credentials=BMCCredentials(
            per_machine={"wrong-password": Credentials(USERNAME, "nope")}, default=good
        ),
        bmc_timeout=5.0,
    )
    unlimited = Rate(0.0, 1)
    await Provisioner(
        provider, ProvisionerConfig(creation_rate=unlimited, reconciler_rate=unlimited)
    ).reconcile(bmdb_conn)
    async with RedfishClient() as redfish:
        await redfish.reset(sushy.system_url(SYSTEMS[0]), good, "ForceOff")
    clock = Clock()
    # Settled machines asked every pass: the fake BMC's ForceOff lands 1..11 s late.
    updater = Updater(provider, UpdaterConfig(batch_size=2, settled_interval=0), clock=clock)

    result = await updater.update_once(bmdb_conn)

    assert sorted(result.failed) == ["unreachable", "wrong-password"]
    assert "401 Unauthorized" in result.failed["wrong-password"]
    assert "ConnectError" in result.failed["unreachable"]
    rows = await _rows(bmdb_conn, Provider.STATIC)
    # The fake BMC applies ForceOff within 11 s; until then it still says On.
    assert rows["good"].status in (ProviderStatus.STOPPED, ProviderStatus.RUNNING)
    assert rows["no-bmc"].status == ProviderStatus.RUNNING
    assert rows["wrong-password"].status == ProviderStatus.RUNNING  # untouched

    # The loop goes on: failed machines wait, the others are refreshed.
    again = await updater.update_once(bmdb_conn)
    assert (again.skipped, again.checked) == (2, 2)
    clock.now += 61
    later = await updater.update_once(bmdb_conn)
    assert sorted(later.failed) == ["unreachable", "wrong-password"]
    clock.now += 61  # the second failure doubled the wait: still in backoff
    assert (await updater.update_once(bmdb_conn)).skipped == 2


async def test_bmc_power_off_becomes_stopped(bmdb_conn: bmdb.Connection, sushy: Sushy) -> None:
    good = Credentials(USERNAME, PASSWORD)
    provider = StaticProvider(
        [Machine("m", "192.0.2.1", bmc=sushy.system_url(SYSTEMS[2]))],
        credentials=BMCCredentials(default=good),
    )
    unlimited = Rate(0.0, 1)
    await Provisioner(
        provider, ProvisionerConfig(creation_rate=unlimited, reconciler_rate=unlimited)
    ).reconcile(bmdb_conn)
    async with RedfishClient() as redfish:
        await redfish.reset(sushy.system_url(SYSTEMS[2]), good, "ForceRestart")
    # ForceRestart: Off at once in the fake driver.
    await Updater(provider).update_once(bmdb_conn)
    assert (await _rows(bmdb_conn, Provider.STATIC))["m"].status == ProviderStatus.STOPPED
