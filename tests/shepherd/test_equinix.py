"""The Equinix client and provider against the local Equinix API server."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from bmdb import ProviderStatus
from shepherd.providers import Capability, MachineNotFound
from shepherd.providers.equinix.client import (
    EquinixAPIError,
    EquinixClient,
    EquinixMalformedResponse,
    EquinixRaceLost,
    EquinixUnavailable,
    RetryPolicy,
)
from shepherd.providers.equinix.localserver import Fault, LocalEquinix
from shepherd.providers.equinix.provider import (
    EquinixConfig,
    EquinixConfigError,
    EquinixProvider,
)
from shepherd.ssh_key import SSHKey

PREFIX = "shepherd-test-"


class Sleeps:
    """Records the waits of the client's retries instead of sleeping them."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)


@pytest.fixture
def sleeps() -> Sleeps:
    return Sleeps()


@pytest.fixture
async def client(equinix: LocalEquinix, sleeps: Sleeps) -> AsyncIterator[EquinixClient]:
    retry = RetryPolicy(initial=0.01, maximum=0.1, attempts=4)
    async with EquinixClient(
        equinix.token, base_url=equinix.url, retry=retry, sleep=sleeps, per_page=7
    ) as c:
        yield c


def provider_for(equinix: LocalEquinix, client: EquinixClient) -> EquinixProvider:
    config = EquinixConfig(equinix.project_id, "shepherd-test", PREFIX)
    return EquinixProvider(client, config, SSHKey.generate().authorized_key)


async def test_lists_devices_over_pages_and_keeps_only_ours(
    equinix: LocalEquinix, client: EquinixClient
) -> None:
    for i in range(20):
        equinix.add_device(f"{PREFIX}{i}")
    equinix.add_device("someone-elses-box")
    provider = provider_for(equinix, client)
    machines = await provider.list_machines()
    assert len(machines) == 20
    # 21 devices at 7 per page: three pages.
    assert [r.path for r in equinix.requests].count(f"/projects/{equinix.project_id}/devices") == 3
    assert all(m.status == ProviderStatus.RUNNING and m.location == "fr2" for m in machines)
    other = next(d for d in equinix.devices.values() if d["hostname"] == "someone-elses-box")
    with pytest.raises(MachineNotFound, match="not ours"):
        await provider.get_machine(other["id"])
    with pytest.raises(MachineNotFound, match="no device"):
        await provider.get_machine("00000000-0000-0000-0000-000000000000")


async def test_address_is_public_ipv4_else_ipv6_else_none(
    equinix: LocalEquinix, client: EquinixClient
) -> None:
    provider = provider_for(equinix, client)
    v4 = equinix.add_device(f"{PREFIX}v4")
    v6 = equinix.add_device(f"{PREFIX}v6")
    v6["ip_addresses"] = [a for a in v6["ip_addresses"] if a["address_family"] == 6]
    none = equinix.add_device(f"{PREFIX}none", ip_addresses=[])
    assert (await provider.get_machine(v4["id"])).address == v4["ip_addresses"][0]["address"]
    assert (await provider.get_machine(v6["id"])).address == v6["ip_addresses"][0]["address"]
    assert ":" in str((await provider.get_machine(v6["id"])).address)
    assert (await provider.get_machine(none["id"])).address is None


async def test_500_and_429_are_retried_honouring_retry_after(
    equinix: LocalEquinix, client: EquinixClient, sleeps: Sleeps
) -> None:
    device = equinix.add_device(f"{PREFIX}1")
    path = f"/devices/{device['id']}"
    equinix.inject("GET", path, Fault(status=500, message="oops"))
    equinix.inject("GET", path, Fault(status=429, retry_after=7.5, message="slow down"))

    assert (await client.get_device(device["id"]))["id"] == device["id"]

    assert [r.status for r in equinix.requests] == [500, 429, 200]
    # The backoff after the 500 is the policy's; after the 429 the server's.
    assert sleeps.waits == [0.01, 7.5]


async def test_connection_errors_and_slow_answers_are_transient(
    equinix: LocalEquinix, sleeps: Sleeps
) -> None:
    device = equinix.add_device(f"{PREFIX}1")
    path = f"/devices/{device['id']}"
    equinix.inject("GET", path, Fault(drop=True))
    equinix.inject("GET", path, Fault(delay=2.0))
    retry = RetryPolicy(initial=0.01, attempts=3)
    async with EquinixClient(
        equinix.token, base_url=equinix.url, retry=retry, sleep=sleeps, timeout=0.5
    ) as c:
        assert (await c.get_device(device["id"]))["id"] == device["id"]
    assert len(sleeps.waits) == 2  # one for the dropped connection, one for the timeout


@pytest.mark.parametrize("status", [401, 403, 404, 422])
async def test_permanent_errors_are_raised_at_once_with_the_api_message(
    equinix: LocalEquinix, client: EquinixClient, sleeps: Sleeps, status: int
) -> None:
    equinix.inject("GET", "/devices/.*", Fault(status=status, message=f"no way {status}"))
    with pytest.raises(EquinixAPIError, match=rf"GET /devices/x: {status}: no way {status}"):
        await client.get_device("x")
    assert sleeps.waits == []
    assert len(equinix.requests) == 1


async def test_bad_token_and_bad_project_are_permanent(
    equinix: LocalEquinix, client: EquinixClient, sleeps: Sleeps
) -> None:
    async with EquinixClient("wrong", base_url=equinix.url, sleep=sleeps) as bad:
        with pytest.raises(EquinixAPIError, match="401: Invalid authentication token"):
            await bad.list_devices(equinix.project_id)
    other = "11111111-1111-4111-8111-111111111111"
    config = EquinixConfig(other, "shepherd-test", PREFIX)
    provider = EquinixProvider(client, config, SSHKey.generate().authorized_key)
    with pytest.raises(EquinixAPIError, match=rf"GET /projects/{other}/ssh-keys: 404: Not found"):
        await provider.ensure_ssh_key()
    with pytest.raises(EquinixAPIError, match="404"):
        await provider.list_machines()
    assert sleeps.waits == []


async def test_transient_errors_give_up_after_the_budget(
    equinix: LocalEquinix, client: EquinixClient, sleeps: Sleeps
) -> None:
    equinix.inject("GET", "/devices/.*", Fault(status=503, message="down"), times=10)
    with pytest.raises(EquinixUnavailable, match="gave up after 4 attempts: 503"):
        await client.get_device("x")
    assert len(sleeps.waits) == 3


async def test_malformed_json_is_retried_then_a_clear_error(
    equinix: LocalEquinix, client: EquinixClient, sleeps: Sleeps
) -> None:
    device = equinix.add_device(f"{PREFIX}1")
    path = f"/devices/{device['id']}"
    equinix.inject("GET", path, Fault(malformed=b'{"id": "trunc'))
    assert (await client.get_device(device["id"]))["id"] == device["id"]
    equinix.inject("GET", path, Fault(malformed=b"<html>proxy error</html>"), times=4)
    with pytest.raises(EquinixMalformedResponse, match="not JSON: '<html>proxy error"):
        await client.get_device(device["id"])
    equinix.inject("GET", path, Fault(malformed=b"[1, 2]"), times=4)
    with pytest.raises(EquinixMalformedResponse, match="not a JSON object"):
        await client.get_device(device["id"])


async def test_ssh_key_is_ensured_under_its_label(
    equinix: LocalEquinix, client: EquinixClient
) -> None:
    key = SSHKey.generate().authorized_key
    config = EquinixConfig(equinix.project_id, "shepherd-test", PREFIX)
    provider = EquinixProvider(client, config, key)
    key_id = await provider.ensure_ssh_key()
    assert equinix.ssh_keys[key_id]["label"] == "shepherd-test"
    assert equinix.ssh_keys[key_id]["key"] == key.strip()
    assert await provider.ensure_ssh_key() == key_id  # again: the same key, not a second
    # Another Shepherd key under the label (e.g. a regenerated key): replaced.
    new_key = SSHKey.generate().authorized_key
    assert await EquinixProvider(client, config, new_key).ensure_ssh_key() == key_id
    assert equinix.ssh_keys[key_id]["key"] == new_key.strip()
    assert len(equinix.ssh_keys) == 1


async def test_device_creation_is_idempotent_when_the_answer_is_lost(
    equinix: LocalEquinix, client: EquinixClient
) -> None:
    (rid,) = equinix.add_reservations(1)
    equinix.provisioning_delay = 3600
    provider = provider_for(equinix, client)
    path = f"/projects/{equinix.project_id}/devices"
    # The device is created, but the answer never arrives.
    equinix.inject("POST", path, Fault(drop=True, after=True))

    machine = await provider.create_machine(rid)

    assert list(equinix.devices) == [machine.id]
    assert equinix.devices[machine.id]["hostname"] == PREFIX + rid[:18]
    assert machine.status == ProviderStatus.PROVISIONING
    assert await provider.creation_slots() == []


async def test_a_reservation_taken_by_someone_else_is_a_lost_race_and_set_aside(
    equinix: LocalEquinix, client: EquinixClient
) -> None:
    rid, free = equinix.add_reservations(2)
    provider = provider_for(equinix, client)
    assert sorted(await provider.creation_slots()) == sorted([rid, free])
    # Between our listing and our create, someone else deploys the reservation.
    other = equinix.add_device("someone-else")
    equinix.reservations[rid]["device"] = {"id": other["id"], "href": other["href"]}

    with pytest.raises(EquinixRaceLost, match=f"reservation {rid} holds device"):
        await provider.create_machine(rid)
    assert list(equinix.devices) == [other["id"]]
    equinix.reservations[rid]["device"] = None  # even if it came free again: set aside
    assert await provider.creation_slots() == [free]


async def test_422_on_create_is_not_retried_and_sets_the_reservation_aside(
    equinix: LocalEquinix, client: EquinixClient, sleeps: Sleeps
) -> None:
    rid, other = equinix.add_reservations(2)
    provider = provider_for(equinix, client)
    path = f"/projects/{equinix.project_id}/devices"
    equinix.inject("POST", path, Fault(status=422, message="Plan not available"))
    with pytest.raises(EquinixAPIError, match="422: Plan not available"):
        await provider.create_machine(rid)
    assert equinix.devices == {}
    assert sleeps.waits == []
    assert [r.status for r in equinix.requests if r.method == "POST" and r.path == path] == [422]
    assert await provider.creation_slots() == [other]


async def test_reboot_goes_through_the_api(equinix: LocalEquinix, client: EquinixClient) -> None:
    provider = provider_for(equinix, client)
    assert Capability.REBOOT in provider.capabilities
    device = equinix.add_device(f"{PREFIX}1")
    await provider.reboot(device["id"])
    assert device["actions_log"] == ["reboot"]
    other = equinix.add_device("not-ours")
    with pytest.raises(MachineNotFound):
        await provider.reboot(other["id"])
    assert "actions_log" not in other


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        (EquinixConfig("", "l", "p-"), "--equinix-project-id must be set"),
        (EquinixConfig("project-1", "l", "p-"), "'project-1' is not a project UUID"),
        (
            EquinixConfig("11111111-1111-4111-8111-111111111111", "shepherd-FIXME", "p-"),
            "--equinix-ssh-key-label 'shepherd-FIXME' still contains FIXME",
        ),
        (
            EquinixConfig("11111111-1111-4111-8111-111111111111", "l", "shepherd-FIXME-"),
            "--equinix-device-prefix 'shepherd-FIXME-' still contains FIXME",
        ),
        (
            EquinixConfig("11111111-1111-4111-8111-111111111111", "l", ""),
            "--equinix-device-prefix must be set",
        ),
    ],
)
def test_bad_config_is_refused(config: EquinixConfig, problem: str) -> None:
    with pytest.raises(EquinixConfigError, match=problem):
        config.check()
