"""Redfish BMCs of static machines, against OpenStack's sushy-tools emulator."""

from __future__ import annotations

import datetime
import ipaddress
import socket
from pathlib import Path

import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from shepherd.providers import Capability, Machine, PowerState, ProviderUnsupported
from shepherd.providers.redfish import (
    BMCConfigError,
    BMCCredentials,
    BMCError,
    Credentials,
    RedfishClient,
    load_credentials,
    parse_system_url,
)
from shepherd.providers.static import StaticFileError, StaticProvider, load_machines
from tests.fixtures.sushy import PASSWORD, SYSTEMS, USERNAME, Sushy, running_sushy

GOOD = BMCCredentials(default=Credentials(USERNAME, PASSWORD))


def _provider(sushy: Sushy, credentials: BMCCredentials = GOOD) -> StaticProvider:
    return StaticProvider(
        [
            Machine("m-1", "192.0.2.1", bmc=sushy.system_url(SYSTEMS[0])),
            Machine("m-2", "192.0.2.2", bmc=sushy.system_url(SYSTEMS[1])),
            Machine("no-bmc", "192.0.2.3"),
        ],
        credentials=credentials,
    )


async def _wait_power(provider: StaticProvider, machine_id: str, want: PowerState) -> None:
    with trio.fail_after(60):  # the fake driver applies a change POWER_DELAY s later
        while (await provider.refresh(machine_id)).power != want:  # noqa: ASYNC110 (state is in the BMC)
            await trio.sleep(0.2)


async def test_power_cycle_turns_the_system_off_and_on_again(sushy: Sushy) -> None:
    provider = _provider(sushy)
    assert provider.capabilities == {Capability.REBOOT, Capability.REFRESH}
    assert (await provider.refresh("m-1")).power == PowerState.ON

    await provider.reboot("m-1")

    # sushy's fake driver turns a ForceRestart into Off now, On a few seconds later.
    assert (await provider.refresh("m-1")).power == PowerState.OFF
    assert (await provider.refresh("m-2")).power == PowerState.ON  # the other one is untouched
    await _wait_power(provider, "m-1", PowerState.ON)


async def test_reboot_of_a_system_that_is_off_powers_it_on(sushy: Sushy) -> None:
    provider = _provider(sushy)
    credentials = GOOD.for_machine("m-2")
    async with RedfishClient() as redfish:
        await redfish.reset(sushy.system_url(SYSTEMS[1]), credentials, "ForceOff")
    await _wait_power(provider, "m-2", PowerState.OFF)

    await provider.reboot("m-2")

    await _wait_power(provider, "m-2", PowerState.ON)


async def test_get_machine_does_not_ask_the_bmc(sushy: Sushy) -> None:
    # The initializer calls get_machine; a dead BMC must not stop an agent start.
    sushy.process.kill()
    sushy.process.wait()
    machine = await _provider(sushy).get_machine("m-1")
    assert (machine.address, machine.power) == ("192.0.2.1", None)


async def test_wrong_password_is_a_clear_error(sushy: Sushy) -> None:
    provider = _provider(sushy, BMCCredentials(default=Credentials(USERNAME, "wrong")))
    with pytest.raises(
        BMCError, match=r"401 Unauthorized: Incorrect username or password \(user 'admin'\)"
    ) as info:
        await provider.refresh("m-1")
    assert sushy.system_url(SYSTEMS[0]) in str(info.value)
    assert "wrong" not in str(info.value)  # the password is never in a message
    with pytest.raises(BMCError, match="401"):
        await provider.reboot("m-1")
    # Without any credentials: the same, and it says so.
    with pytest.raises(BMCError, match="no credentials"):
        await _provider(sushy, BMCCredentials()).refresh("m-1")


async def test_unreachable_bmc_is_a_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/redfish/v1/Systems/1"
    provider = StaticProvider([Machine("m", "192.0.2.1", bmc=url)], credentials=GOOD)
    with pytest.raises(BMCError, match=rf"BMC {url}: ConnectError"):
        await provider.refresh("m")
    with pytest.raises(BMCError, match="ConnectError"):
        await provider.reboot("m")


async def test_unknown_system_is_a_clear_error(sushy: Sushy) -> None:
    url = sushy.system_url("no-such-system")
    provider = StaticProvider([Machine("m", "192.0.2.1", bmc=url)], credentials=GOOD)
    with pytest.raises(BMCError, match="404"):
        await provider.refresh("m")


async def test_machines_without_a_bmc_cannot_be_rebooted() -> None:
    provider = StaticProvider([Machine("m", "192.0.2.1")])
    assert provider.capabilities == frozenset()
    with pytest.raises(ProviderUnsupported, match="has no BMC"):
        await provider.reboot("m")
    assert (await provider.refresh("m")).power is None


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("https://bmc.example/redfish/v1/Managers/1", "not a Redfish system URL"),
        ("https://bmc.example/redfish/v1/Systems/", "not a Redfish system URL"),
        ("ipmi://bmc.example/redfish/v1/Systems/1", "not a Redfish system URL"),
        ("bmc.example", "not a Redfish system URL"),
        ("https://root:calvin@bmc.example/redfish/v1/Systems/1", "contains credentials"),
        ("https://bmc.example:99999/redfish/v1/Systems/1", "out of range"),
    ],
)
def test_bmc_urls_that_are_not_redfish_systems_are_refused(
    tmp_path: Path, url: str, problem: str
) -> None:
    with pytest.raises(BMCConfigError, match=problem):
        parse_system_url(url)
    path = tmp_path / "machines.toml"
    path.write_text(f'[[machine]]\nid = "m"\naddress = "a"\nbmc = "{url}"\n')
    with pytest.raises(StaticFileError, match=rf"machines.toml:4: .*{problem}") as info:
        load_machines(path)
    assert "calvin" not in str(info.value)


def test_bmc_url_is_loaded_and_normalised(tmp_path: Path) -> None:
    path = tmp_path / "machines.toml"
    path.write_text(
        '[[machine]]\nid = "m"\naddress = "a"\nbmc = "https://b:8443/redfish/v1/Systems/1/"\n'
    )
    (machine,) = load_machines(path)
    assert machine.bmc == "https://b:8443/redfish/v1/Systems/1"
    assert StaticProvider([machine]).capabilities == {Capability.REBOOT, Capability.REFRESH}


def test_credentials_from_file_and_environment(tmp_path: Path) -> None:
    path = tmp_path / "bmc.toml"
    path.write_text(
        '[default]\nusername = "admin"\npassword = "p1"\n'
        '[machine."rack-1"]\nusername = "root"\npassword = "p2"\n'
    )
    loaded = load_credentials(path, environ={})
    assert loaded.for_machine("rack-1") == Credentials("root", "p2")
    assert loaded.for_machine("other") == Credentials("admin", "p1")
    assert "p1" not in repr(loaded) and "p2" not in repr(loaded)

    env = {"SHEPHERD_BMC_USERNAME": "u", "SHEPHERD_BMC_PASSWORD": "p"}
    assert load_credentials(None, environ=env).for_machine("x") == Credentials("u", "p")
    assert load_credentials(None, environ={}).for_machine("x") is None
    with pytest.raises(BMCConfigError, match="set both"):
        load_credentials(None, environ={"SHEPHERD_BMC_USERNAME": "u"})

    path.write_text('[default]\nusername = "admin"\n')
    with pytest.raises(BMCConfigError, match=r"bmc.toml: \[default\] needs"):
        load_credentials(path, environ={})
    path.write_text("[default\n")
    with pytest.raises(BMCConfigError, match=r"bmc\.toml"):
        load_credentials(path, environ={})


def _tls_files(directory: Path) -> tuple[Path, Path, Path]:
    """A CA, and a certificate it signed for 127.0.0.1: (ca.pem, cert.pem, key.pem)."""
    now = datetime.datetime.now(datetime.UTC)

    def build(
        subject: str,
        issuer: x509.Name,
        key: ec.EllipticCurvePrivateKey,
        signer: ec.EllipticCurvePrivateKey,
        ca: bool,
    ) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False,
            )
        return builder.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test BMC CA")])
    ca = build("test BMC CA", ca_name, ca_key, ca_key, ca=True)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = build("127.0.0.1", ca_name, key, ca_key, ca=False)
    paths = directory / "ca.pem", directory / "cert.pem", directory / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths


async def test_https_bmc_is_checked_against_the_given_ca(tmp_path: Path) -> None:
    ca, cert, key = _tls_files(tmp_path)
    with running_sushy(tmp_path / "sushy", tls=(cert, key)) as server:
        assert server.base_url.startswith("https://")
        machines = [Machine("m", "192.0.2.1", bmc=server.system_url(SYSTEMS[0]))]
        trusting = StaticProvider(machines, credentials=GOOD, bmc_verify=str(ca))
        assert (await trusting.refresh("m")).power == PowerState.ON
        with pytest.raises(BMCError, match="CERTIFICATE_VERIFY_FAILED"):
            await StaticProvider(machines, credentials=GOOD).refresh("m")


@pytest.mark.parametrize("key", ["password", "username", "bmc_password"])
def test_credentials_in_the_machines_file_are_refused(tmp_path: Path, key: str) -> None:
    path = tmp_path / "machines.toml"
    path.write_text(
        f'[[machine]]\nid = "m"\naddress = "a"\n'
        f'bmc = "https://b/redfish/v1/Systems/1"\n{key} = "hunter2"\n'
    )
    with pytest.raises(StaticFileError, match=rf"machines.toml:5: unknown field '{key}'") as info:
        load_machines(path)
    assert "hunter2" not in str(info.value)
