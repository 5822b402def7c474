"""Provisioner and initializer together: Equinix devices (local API) to AgentStarted.

The local API hands out addresses 127.0.0.X; an asyncssh machine of
:mod:`shepherd.localfleet` listens on each, on one shared port, so the
initializer dials exactly the address the provider reported.
"""

from __future__ import annotations

import socket
from pathlib import Path

import trio

import bmdb
from bmdb import Provider, Queries
from shepherd.agent_bundle import agent_zipapp
from shepherd.agent_start import AgentConfig
from shepherd.control_loop import run_control_loop
from shepherd.initializer import Initializer
from shepherd.localfleet import open_fleet
from shepherd.providers.equinix.client import EquinixClient, RetryPolicy
from shepherd.providers.equinix.localserver import LocalEquinix
from shepherd.providers.equinix.provider import EquinixConfig, EquinixProvider
from shepherd.provisioner import Provisioner, ProvisionerConfig
from shepherd.rate_limit import Rate, RateLimiter
from shepherd.ssh import SSHClient
from shepherd.ssh_key import SSHKey
from tests.shepherd.helpers import agent_keys

COUNT = 4
HOSTS = [f"127.0.0.{20 + i}" for i in range(COUNT)]


def _shared_port() -> int:
    with socket.socket() as s:
        s.bind((HOSTS[0], 0))
        port: int = s.getsockname()[1]
        return port


async def test_provisioner_and_initializer_bring_devices_to_agent_started(
    aio_loop: object,
    bmdb_conn: bmdb.Connection,
    equinix: LocalEquinix,
    shepherd_ssh_key: SSHKey,
    tmp_path: Path,
) -> None:
    equinix.add_reservations(COUNT + 2)
    equinix.ipv4_for = lambda n: HOSTS[n] if n < COUNT else None
    equinix.provisioning_delay = 0.5
    port = _shared_port()
    async with (
        open_fleet(
            tmp_path,
            count=COUNT,
            authorized_key=shepherd_ssh_key.authorized_key,
            hosts=HOSTS,
            port=port,
        ) as fleet,
        EquinixClient(
            equinix.token, base_url=equinix.url, retry=RetryPolicy(initial=0.05)
        ) as client,
    ):
        config = EquinixConfig(equinix.project_id, "shepherd-e2e", "shepherd-e2e-")
        provider = EquinixProvider(client, config, shepherd_ssh_key.authorized_key, ssh_port=port)
        provisioner = Provisioner(
            provider,
            ProvisionerConfig(
                max_machines=COUNT,
                creation_rate=Rate(0.0, 1),
                reconciler_rate=Rate(0.2, 1),
            ),
        )
        ssh = SSHClient(shepherd_ssh_key, username="root", connect_timeout=10.0)
        agent = AgentConfig(
            executable=agent_zipapp(),
            target_path="/agent",
            endpoint="bmaas.example:443",
            endpoint_ca_certificate=b"",
            ssh_connect_timeout=10.0,
            ssh_exec_timeout=60.0,
        )
        initializer = Initializer(provider, ssh, agent)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(provisioner.run, bmdb_conn)
            nursery.start_soon(
                lambda: run_control_loop(
                    bmdb_conn,
                    initializer,
                    parallelism=2,
                    limiter=RateLimiter(Rate(0.01, 8)),
                    session_interval=10.0,
                )
            )
            with trio.fail_after(120):
                while len(await agent_keys(bmdb_conn)) < COUNT:  # noqa: ASYNC110 (state in Postgres)
                    await trio.sleep(0.1)
            nursery.cancel_scope.cancel()

    async def read(q: Queries) -> dict[str, str | None]:
        return {p.provider_id: p.address for p in await q.provided_by_provider(Provider.EQUINIX)}

    provided = await bmdb_conn.transact(read)
    assert len(equinix.devices) == COUNT  # the limit, though 2 more reservations were free
    assert sorted(provided) == sorted(equinix.devices)
    assert sorted(a for a in provided.values() if a) == HOSTS
    assert sorted(m.execs for m in fleet.machines) == [1] * COUNT
    assert all(k for k in equinix.ssh_keys.values() if k["label"] == "shepherd-e2e")
