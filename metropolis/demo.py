"""A three-node cluster on loopback, from nothing, with a live node table.

``python -m metropolis.demo`` (or ``bin/cluster-demo``): node 1 bootstraps on
127.0.0.1; nodes 2 and 3 register on 127.0.0.2 and .3 with the owner's
ticket; the owner approves them and grants ConsensusMember to each in turn.
Every node is its own ``python -m metropolis node`` process with its own
etcd. The table is redrawn as the cluster changes; at the end a summary
says how long each step took and what etcd reports. SIGINT (Ctrl-C) or
the end stops every node (SIGTERM, then SIGKILL after a grace period); no
process is left running. Node logs are in the work directory, removed
afterwards unless ``--keep``.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import IO

import trio

from common.net import free_loopback_port
from metropolis import pki
from metropolis.consensus.client import Client
from metropolis.consensus.process import SOCKET_NAME
from metropolis.errors import MetropolisError
from metropolis.localstorage import Root
from metropolis.owner import NodeRow, Owner, format_table, open_owner

ADDRESSES = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
STEP_TIMEOUT = 180.0


def _out(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


@asynccontextmanager
async def _processes() -> AsyncIterator[list[trio.Process]]:
    """Processes started inside are stopped on the way out, whatever happens."""
    procs: list[trio.Process] = []
    try:
        yield procs
    finally:
        with trio.CancelScope(shield=True):
            for p in procs:
                if p.returncode is None:
                    p.send_signal(signal.SIGTERM)
            with trio.move_on_after(30):
                for p in procs:
                    await p.wait()
            for p in procs:
                if p.returncode is None:
                    p.kill()
                    await p.wait()


async def _start(procs: list[trio.Process], log: IO[bytes], *args: str) -> None:
    procs.append(
        await trio.lowlevel.open_process(
            [sys.executable, "-m", "metropolis", "node", *args], stderr=log, stdout=log
        )
    )


async def _until(what: str, check: Callable[[], Awaitable[bool]]) -> float:
    """Poll ``check`` (state lives in other processes); return the seconds it took."""
    start = time.monotonic()
    while time.monotonic() - start < STEP_TIMEOUT:
        try:
            if await check():
                return time.monotonic() - start
        except MetropolisError:
            pass  # a curator not up yet, or changing leaders
        await trio.sleep(0.25)
    raise MetropolisError(f"gave up waiting for {what} after {STEP_TIMEOUT:.0f} s")


async def _table(owner: Owner, last: list[str]) -> list[NodeRow]:
    rows = await owner.nodes()
    table = format_table(rows)
    if not last or table != last[0]:
        last[:] = [table]
        _out(f"\n[{time.strftime('%H:%M:%S')}]\n{table}")
    return rows


async def run(work: Path) -> None:
    roots = [Root(work / f"n{i}") for i in (1, 2, 3)]
    owner_key = work / "owner.pem"
    common = [
        *("--peer-port", str(free_loopback_port())),
        *("--curator-port", str(free_loopback_port())),
        *("--debug-port", str(free_loopback_port())),
        *("--raft-tuning", "20,200", "--insecure-seal"),
    ]
    timings: list[tuple[str, float]] = []
    last: list[str] = []
    async with _processes() as procs:
        with (work / "n1.log").open("wb") as log:
            await _start(
                procs,
                log,
                *("bootstrap", "--root", str(roots[0].path), "--address", ADDRESSES[0]),
                *("--owner-key-out", str(owner_key), *common),
            )
        _out(f"node 1 bootstrapping on {ADDRESSES[0]} (logs in {work})")

        async def ready() -> bool:
            key = pki.decode_private_key(owner_key.read_bytes())
            async with open_owner(roots[0], key) as owner:
                info = await owner.info()
                return info.cluster_directory is not None and bool(info.cluster_directory.nodes)

        async def owner_exists() -> bool:
            return owner_key.exists() and (roots[0].path / "data").exists()

        await _until("owner key", owner_exists)
        timings.append(("bootstrap, curator serving", await _until("bootstrap", ready)))
        key = pki.decode_private_key(owner_key.read_bytes())
        async with open_owner(roots[0], key) as owner:
            ticket = (await owner.ticket()).hex()
            cluster = work / "cluster.pb"
            cluster.write_bytes(bytes(await owner.info()))
            for i, root in ((2, roots[1]), (3, roots[2])):
                with (work / f"n{i}.log").open("wb") as log:
                    await _start(
                        procs,
                        log,
                        *("register", "--root", str(root.path), "--address", ADDRESSES[i - 1]),
                        *("--ticket", ticket, "--directory", str(cluster), *common),
                    )
            _out("nodes 2 and 3 registering")

            async def registered() -> bool:
                return sum(r.state == "NEW" for r in await _table(owner, last)) == 2

            timings.append(("register n2, n3", await _until("register", registered)))
            for row in await owner.nodes():
                if row.state == "NEW":
                    await owner.approve(row.node_id)

            async def up() -> bool:
                rows = await _table(owner, last)
                return sum(r.state == "UP" and bool(r.address) for r in rows) == 3

            timings.append(("approve, commit, status", await _until("up", up)))
            for address in ADDRESSES[1:]:
                row = next(r for r in await owner.nodes() if r.address == address)
                await owner.set_roles(row.node_id, consensus_member=True)

                async def voting(address: str = address) -> bool:
                    rows = {r.address: r for r in await _table(owner, last)}
                    async with Client(roots[0].ephemeral.consensus / SOCKET_NAME) as etcd:
                        members = await etcd.member_list()
                    return rows[address].curator and not any(m.is_learner for m in members)

                timings.append((f"ConsensusMember {address}", await _until("grant", voting)))
            rows = await _table(owner, last)
            async with Client(roots[0].ephemeral.consensus / SOCKET_NAME) as etcd:
                members = await etcd.member_list()
        _out("\nsummary")
        for what, seconds in timings:
            _out(f"  {what:<32} {seconds:6.2f} s")
        voters = sum(not m.is_learner for m in members)
        leaders = [r.node_id for r in rows if r.leader]
        _out(f"  etcd voters: {voters}; curators running: {sum(r.curator for r in rows)}")
        _out(f"  leader: {', '.join(leaders) or 'unknown'}")
        _out("stopping every node")
    _out("all nodes stopped")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m metropolis.demo", description=__doc__)
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="metropolis-demo-"))
    try:
        trio.run(run, work)
    except MetropolisError as e:
        _out(f"failed: {e} (logs in {work})")
        args.keep = True
        return 1
    except KeyboardInterrupt:
        _out("interrupted; every node was stopped")
        return 130
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
