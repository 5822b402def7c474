"""The provisioner: static assimilation, and Equinix reconciliation against the local API."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio

import bmdb
from bmdb import Provider, ProviderStatus, Queries
from bmdb.model import MachineProvided
from shepherd.providers import Machine
from shepherd.providers.equinix.client import (
    EquinixClient,
    EquinixMalformedResponse,
    RetryPolicy,
)
from shepherd.providers.equinix.localserver import Fault, LocalEquinix
from shepherd.providers.equinix.provider import EquinixConfig, EquinixProvider
from shepherd.providers.static import StaticProvider
from shepherd.provisioner import (
    Provisioner,
    ProvisionerConfig,
    Reconciliation,
    SyncResult,
    sync_provided,
)
from shepherd.rate_limit import Rate
from shepherd.ssh_key import SSHKey
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


# The provisioner control loop.


def _fast(**overrides: Any) -> ProvisionerConfig:
    unlimited = Rate(0.0, 1)
    return ProvisionerConfig(
        **{"creation_rate": unlimited, "reconciler_rate": unlimited, **overrides}
    )


async def _equinix_ids(conn: bmdb.Connection) -> dict[str, MachineProvided]:
    async def read(q: Queries) -> list[MachineProvided]:
        return await q.provided_by_provider(Provider.EQUINIX)

    return {p.provider_id: p for p in await conn.transact(read)}


@pytest.fixture
async def eq_client(equinix: LocalEquinix) -> AsyncIterator[EquinixClient]:
    retry = RetryPolicy(initial=0.01, maximum=0.05, attempts=4)
    async with EquinixClient(equinix.token, base_url=equinix.url, retry=retry) as client:
        yield client


def _eq_provider(
    equinix: LocalEquinix, client: EquinixClient, cls: type[EquinixProvider] = EquinixProvider
) -> EquinixProvider:
    config = EquinixConfig(equinix.project_id, "shepherd-test", "shepherd-test-")
    return cls(client, config, SSHKey.generate().authorized_key)


async def test_30_reservations_with_max_20_make_exactly_20_machines(
    bmdb_conn: bmdb.Connection, equinix: LocalEquinix, eq_client: EquinixClient
) -> None:
    equinix.add_reservations(30)
    provisioner = Provisioner(_eq_provider(equinix, eq_client), _fast(max_machines=20))

    first = await provisioner.reconcile(bmdb_conn)
    second = await provisioner.reconcile(bmdb_conn)

    assert (len(first.created), first.failed, first.refused) == (20, {}, False)
    assert (second.managed, second.created) == (20, [])
    assert len(equinix.devices) == 20
    recorded = await _equinix_ids(bmdb_conn)
    assert sorted(recorded) == sorted(equinix.devices)
    for pid, row in recorded.items():
        public = equinix.devices[pid]["ip_addresses"][0]["address"]
        assert (row.address, row.location) == (public, "fr2")
    assert sum(r["provisionable"] for r in equinix.reservations.values()) == 10


async def test_chunks_bound_each_reconciliation(
    bmdb_conn: bmdb.Connection, equinix: LocalEquinix, eq_client: EquinixClient
) -> None:
    equinix.add_reservations(30)
    provisioner = Provisioner(
        _eq_provider(equinix, eq_client), _fast(max_machines=20, chunk_size=7)
    )
    created = [len((await provisioner.reconcile(bmdb_conn)).created) for _ in range(4)]
    assert created == [7, 7, 6, 0]
    # No limit: all the rest.
    unlimited = Provisioner(provisioner.provider, _fast(max_machines=0, chunk_size=100))
    assert len((await unlimited.reconcile(bmdb_conn)).created) == 10
    assert len(await _equinix_ids(bmdb_conn)) == len(equinix.devices) == 30


class _Crash(BaseException):
    """The process dying right after the API created the device."""


class _CrashAfterCreate(EquinixProvider):
    async def create_machine(self, slot: str) -> Machine:
        await super().create_machine(slot)
        raise _Crash()


async def test_crash_between_creation_and_bmdb_write_makes_no_second_device(
    bmdb_conn: bmdb.Connection, equinix: LocalEquinix, eq_client: EquinixClient
) -> None:
    equinix.add_reservations(3)
    crashing = Provisioner(_eq_provider(equinix, eq_client, _CrashAfterCreate), _fast())
    with pytest.raises(_Crash):
        await crashing.reconcile(bmdb_conn)
    (orphan,) = equinix.devices

    # Restart: a new provisioner and provider (nothing remembered in memory).
    restarted = Provisioner(_eq_provider(equinix, eq_client), _fast())
    result = await restarted.reconcile(bmdb_conn)

    assert list(equinix.devices) == [orphan]
    assert await _equinix_ids(bmdb_conn) == {}
    assert (result.missing_in_bmdb, result.refused, result.created) == ([orphan], True, [])
    # The operator's way out: assimilate, after which creation resumes.
    adopting = Provisioner(restarted.provider, _fast(assimilate=True))
    result = await adopting.reconcile(bmdb_conn)
    assert (result.added, len(result.created)) == ([orphan], 2)
    assert len(await _equinix_ids(bmdb_conn)) == len(equinix.devices) == 3


async def test_failures_are_per_reservation_and_set_aside(
    bmdb_conn: bmdb.Connection, equinix: LocalEquinix, eq_client: EquinixClient
) -> None:
    bad, good_1, good_2 = equinix.add_reservations(3)
    devices = f"/projects/{equinix.project_id}/devices"
    # 422 for the first create, a 500 and a 429 on the others (retried).
    equinix.inject("POST", devices, Fault(status=422, message="Plan not available here"))
    equinix.inject("POST", devices, Fault(status=500))
    equinix.inject("POST", devices, Fault(status=429, retry_after=0.01))
    order = [bad, good_1, good_2]
    provider = _eq_provider(equinix, eq_client)

    async def slots_in_order() -> list[str]:
        free = set(await EquinixProvider.creation_slots(provider))
        return [s for s in order if s in free]

    provider.creation_slots = slots_in_order  # type: ignore[method-assign]
    result = await Provisioner(provider, _fast()).reconcile(bmdb_conn)

    assert list(result.failed) == [bad]
    assert "422: Plan not available here" in result.failed[bad]
    assert len(result.created) == 2 == len(equinix.devices)
    posts = [r.status for r in equinix.requests if r.method == "POST" and r.path == devices]
    assert posts == [422, 500, 429, 201, 201]
    # Set aside: the next reconciliation does not try it again.
    again = await Provisioner(provider, _fast()).reconcile(bmdb_conn)
    assert (again.created, again.failed, again.managed) == ([], {}, 2)


async def test_bad_input_fails_the_reconciliation_cleanly_and_the_loop_goes_on(
    bmdb_conn: bmdb.Connection, equinix: LocalEquinix, eq_client: EquinixClient
) -> None:
    equinix.add_reservations(2)
    devices = f"/projects/{equinix.project_id}/devices"
    equinix.inject("GET", devices, Fault(malformed=b"{not json"), times=4)
    provisioner = Provisioner(_eq_provider(equinix, eq_client), _fast())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(provisioner.run, bmdb_conn)
        with trio.fail_after(30):
            while not any(isinstance(r, Reconciliation) for r in provisioner.history):  # noqa: ASYNC110
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    first, second = provisioner.history[:2]
    assert isinstance(first, EquinixMalformedResponse)
    assert "not JSON" in str(first)
    assert isinstance(second, Reconciliation) and len(second.created) == 2


async def test_device_without_addresses_is_recorded_without_one(
    bmdb_conn: bmdb.Connection, equinix: LocalEquinix, eq_client: EquinixClient
) -> None:
    equinix.add_reservations(1)
    equinix.ipv4_for = lambda n: None
    provider = _eq_provider(equinix, eq_client)
    result = await Provisioner(provider, _fast()).reconcile(bmdb_conn)
    (device_id,) = result.created
    equinix.devices[device_id]["ip_addresses"] = []
    assert (await provider.get_machine(device_id)).address is None


async def test_machines_missing_on_either_side_are_reported_not_fixed(
    bmdb_conn: bmdb.Connection, equinix: LocalEquinix, eq_client: EquinixClient
) -> None:
    equinix.add_reservations(2)
    provider = _eq_provider(equinix, eq_client)
    assert len((await Provisioner(provider, _fast()).reconcile(bmdb_conn)).created) == 2
    gone = next(iter(equinix.devices))
    equinix.delete_device(gone)
    stray = equinix.add_device("shepherd-test-manual")["id"]

    result = await Provisioner(provider, _fast()).reconcile(bmdb_conn)

    assert result.missing_in_provider == [gone]
    assert result.missing_in_bmdb == [stray]
    assert result.refused and result.created == []
    assert gone in await _equinix_ids(bmdb_conn)  # not deleted
    assert stray not in await _equinix_ids(bmdb_conn)  # not added


async def test_static_provider_assimilates_and_reports_removed_machines(
    bmdb_conn: bmdb.Connection,
) -> None:
    before = await provide(bmdb_conn, ["old"])
    provider = StaticProvider([Machine("new", "192.0.2.1", location="fra1")])
    result = await Provisioner(provider, _fast()).reconcile(bmdb_conn)
    assert (result.added, result.missing_in_provider, result.refused) == (["new"], ["old"], False)
    provided = await _provided(bmdb_conn)
    assert provided["old"].machine_id == before["old"]
    assert provided["new"].address == "192.0.2.1"
    result = await Provisioner(provider, _fast()).reconcile(bmdb_conn)
    assert (result.added, result.managed) == ([], 1)
