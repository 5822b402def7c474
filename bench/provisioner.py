"""Provisioner reconciliation cost against just listing the devices, measured in one run.

    python -m bench.provisioner [--devices 5000] [--rounds 9] [--per-page 1000] [--smoke]

The local Equinix API server runs in its own process with ``--devices``
active devices under the prefix; a BMDB (PostgreSQL) holds the same devices
as provided machines. Alternating, ``--rounds`` times each:

- baseline: ``EquinixClient.list_devices`` (all pages, same client, same HTTP);
- reconcile: one ``Provisioner.reconcile`` (devices and BMDB listed at the
  same time, compared, nothing to create: the fleet is at its limit);
- for insight only, the BMDB listing alone.

Prints the median seconds of each and the ratio reconcile/baseline (goal:
at most 1.5).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from statistics import median

import trio
import trio_asyncio

import bmdb
from bench.ratios import report
from bench.smoke import parse_args
from bmdb import Isolation, Provider, Queries
from bmdb.localserver import TEMPLATE_DB, start_with_template
from shepherd.providers.equinix.client import EquinixClient
from shepherd.providers.equinix.provider import EquinixConfig, EquinixProvider
from shepherd.provisioner import Provisioner, ProvisionerConfig
from shepherd.rate_limit import Rate
from shepherd.ssh_key import SSHKey

PREFIX = "bench-"


def start_api(devices: int) -> tuple[subprocess.Popen[str], str, str, str]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shepherd.providers.equinix.localserver",
            "--reservations",
            "0",
            "--devices",
            str(devices),
            "--device-prefix",
            PREFIX,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    fields = dict(item.split("=", 1) for item in line.split())
    return process, fields["url"], fields["project"], fields["token"]


async def fill_bmdb(conn: bmdb.Connection, devices: list[dict[str, object]]) -> None:
    machine_ids = [uuid.uuid4() for _ in devices]
    provider_ids = [str(d["id"]) for d in devices]

    async def fill(q: Queries) -> None:
        await q.execute(
            "INSERT INTO machines (machine_id) SELECT unnest(%s::uuid[])", (machine_ids,)
        )
        await q.execute(
            "INSERT INTO machine_provided (machine_id, provider, provider_id, provider_status)"
            " SELECT unnest(%s::uuid[]), 'Equinix', unnest(%s::text[]), 'Running'",
            (machine_ids, provider_ids),
        )

    await conn.transact(fill, isolation=Isolation.READ_COMMITTED)


async def main_async(
    args: argparse.Namespace, url: str, project: str, token: str, db: str
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"list devices": [], "reconcile": [], "(list BMDB)": []}
    async with (
        trio_asyncio.open_loop(),
        bmdb.open_connection(db) as conn,
        EquinixClient(token, base_url=url, per_page=args.per_page) as client,
    ):
        await fill_bmdb(conn, await client.list_devices(project))
        provider = EquinixProvider(
            client, EquinixConfig(project, "bench", PREFIX), SSHKey.generate().authorized_key
        )
        config = ProvisionerConfig(
            max_machines=args.devices, creation_rate=Rate(0.0, 1), reconciler_rate=Rate(0.0, 1)
        )
        provisioner = Provisioner(provider, config)

        async def read_bmdb(q: Queries) -> object:
            return await q.provided_by_provider(Provider.EQUINIX)

        for _ in range(args.rounds):
            start = time.perf_counter()
            listed = await client.list_devices(project)
            times["list devices"].append(time.perf_counter() - start)
            assert len(listed) == args.devices
            start = time.perf_counter()
            result = await provisioner.reconcile(conn)
            times["reconcile"].append(time.perf_counter() - start)
            assert result.managed == args.devices and not result.refused
            start = time.perf_counter()
            await conn.transact(read_bmdb)
            times["(list BMDB)"].append(time.perf_counter() - start)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--per-page", type=int, default=1000)
    args = parse_args(parser, {"devices": 10, "rounds": 1, "per_page": 4})
    root = Path(tempfile.mkdtemp(prefix="bench-provisioner-"))
    api, url, project, token = start_api(args.devices)
    try:
        server = start_with_template(root)
        try:
            db = server.create_database("bench_provisioner", template=TEMPLATE_DB)
            times = trio.run(main_async, args, url, project, token, db)
        finally:
            server.stop()
    finally:
        api.kill()
        api.wait()
        shutil.rmtree(root, ignore_errors=True)
    baseline = median(times["list devices"])
    print(
        f"\n{args.devices} devices ({args.per_page} per page) vs a BMDB of {args.devices} "
        f"machines, {args.rounds} rounds, {os.cpu_count()} CPUs\n"
    )
    print(f"{'operation':<14} {'median s':>9} {'min s':>7} {'ratio':>6}")
    for name, values in times.items():
        mid = median(values)
        print(f"{name:<14} {mid:>9.3f} {min(values):>7.3f} {mid / baseline:>6.2f}")
    report(
        "provisioner", "reconcile / list devices", median(times["reconcile"]) / baseline, "<= 1.5"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
