"""Disaster recovery against etcd's own tools, measured in one run.

    python -m bench.recover [--nodes 1000] [--runs 3] [--smoke]

A node bootstraps a cluster (its own process, on 127.0.0.1 with free
ports, loopback raft timing), and ``--nodes`` node records (UP, with an
address and a role) are written into its etcd, as many nodes would have
left them. Then, median of ``--runs`` each:

- snapshot: :func:`~metropolis.consensus.snapshot.take_snapshot` of the
  node's member, from its start until the file and manifest are durable,
  against ``etcdctl snapshot save`` of a bare etcd holding the same keys
  (restored from the same snapshot) to a file;
- recover: the node stopped and its etcd data deleted, then
  ``metropolis node recover`` (a new process) until the owner's
  ``nodes`` call answers with every record, against ``etcdctl snapshot
  restore`` plus a bare single-member etcd started on the result until it
  answers a read (the same raft timing).

Each recovery of ours runs right after one of the baseline's (the load of
a shared machine moves within seconds). Both recoveries include their
processes' start (Python's and the interpreter's imports for ours, Go
binaries for etcd's). Needs ``etcd`` and
``etcdctl`` (Debian ``etcd-server``, ``etcd-client``). Prints one table;
each figure is also given as a ratio to its baseline (goal: within 3x,
issue 39).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import trio

from bench.ratios import report
from bench.smoke import parse_args
from common.backoff import ExponentialBackoff, Retrier
from common.net import free_loopback_port
from metropolis import pki
from metropolis.consensus.client import Client, Put
from metropolis.consensus.config import CURATOR_NAMESPACE
from metropolis.consensus.process import SOCKET_NAME
from metropolis.consensus.restore import etcdctl
from metropolis.consensus.snapshot import take_snapshot
from metropolis.curator.state import node_key
from metropolis.identity import NodeCredentials, node_id
from metropolis.localstorage import Root
from metropolis.owner import load_owner
from metropolis.proto.common import NodeRoles, NodeRolesKubernetesController, NodeState, NodeStatus
from metropolis.proto.curator import Node
from metropolis.rpc import RPCError

logger = logging.getLogger("bench.recover")

#: Polls of something another process does (its etcd answering, its curator).
POLL = ExponentialBackoff(initial=0.005, maximum=0.05)
_BATCH = 100  # etcd takes at most 128 operations in one transaction


async def _until(check: Callable[[], Awaitable[bool]]) -> None:
    retrier = Retrier(POLL)
    while not await check():
        await retrier.sleep()


class NodeProc:
    """``python -m metropolis node ...`` as a child process, its log in a file."""

    def __init__(self, log: Path, *args: str) -> None:
        self.log = log
        self._out = log.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "metropolis", "node", *args],
            stdout=self._out,
            stderr=self._out,
        )

    def logged(self, text: str) -> bool:
        return text in self.log.read_text(errors="replace")

    async def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        await trio.to_thread.run_sync(self.process.wait)
        self._out.close()


async def _fill(socket: Path, count: int) -> None:
    """``count`` UP node records with an address and a role, in transactions of 100."""
    async with Client(socket) as client:
        kv = client.namespaced(CURATOR_NAMESPACE)
        ops: list[Put] = []
        for i in range(count):
            public = hashlib.sha256(b"bench-node-%d" % i).digest()
            record = Node(
                public_key=public,
                fsm_state=NodeState.UP,
                roles=NodeRoles(kubernetes_controller=NodeRolesKubernetesController()),
                status=NodeStatus(external_address=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}"),
            )
            ops.append(Put(node_key(node_id(public)), bytes(record)))
            if len(ops) == _BATCH or i == count - 1:
                await kv.txn([], ops, [])
                ops = []


async def _ours_snapshot(root: Root, out: Path) -> float:
    credentials = NodeCredentials.load(root.data.node_credentials)
    ca = hashlib.sha256(credentials.ca_certificate.public_bytes(pki.Encoding.DER)).hexdigest()
    start = trio.current_time()
    await take_snapshot(
        root.ephemeral.consensus / SOCKET_NAME,
        out,
        cluster_ca_sha256=ca,
        node_id=credentials.node_id,
    )
    return trio.current_time() - start


async def _bare_recover(snapshot: Path, base: Path, *, nursery: trio.Nursery) -> tuple[float, str]:
    """etcdctl restore + a bare etcd on it until it answers; the time and its client URL.

    The etcd keeps running (for the snapshot baseline) until ``nursery`` ends.
    """
    data = base / "data"
    peer, client = free_loopback_port(), free_loopback_port()
    peer_url, client_url = f"http://127.0.0.1:{peer}", f"http://127.0.0.1:{client}"
    start = trio.current_time()
    await trio.run_process(
        [
            *(etcdctl(), "snapshot", "restore", str(snapshot), "--name=bare"),
            f"--initial-cluster=bare={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--data-dir={data}",
        ],
        capture_stdout=True,
        capture_stderr=True,
        env={**os.environ, "ETCDCTL_API": "3"},
    )
    argv = [
        *(os.environ.get("METROPOLIS_ETCD_BINARY") or "etcd", "--name=bare"),
        *(f"--data-dir={data}", f"--listen-client-urls={client_url}"),
        *(f"--advertise-client-urls={client_url}", f"--listen-peer-urls={peer_url}"),
        *(f"--initial-advertise-peer-urls={peer_url}", f"--initial-cluster=bare={peer_url}"),
        *("--heartbeat-interval=20", "--election-timeout=200"),
    ]
    log = (base / "etcd.log").open("wb")
    process = subprocess.Popen(argv, stdout=log, stderr=log)  # noqa: ASYNC220 (kept running)

    async def stop() -> None:
        try:
            await trio.sleep_forever()
        finally:
            process.terminate()
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(process.wait)
                log.close()

    nursery.start_soon(stop)
    async with httpx.AsyncClient(base_url=client_url) as http:

        async def answers() -> bool:
            try:
                response = await http.post("/v3/kv/range", json={"key": "AA=="})
            except httpx.TransportError:
                return False
            return response.status_code == 200

        await _until(answers)
    return trio.current_time() - start, client_url


async def _bare_snapshot(client_url: str, out: Path) -> float:
    start = trio.current_time()
    await trio.run_process(
        [etcdctl(), f"--endpoints={client_url}", "snapshot", "save", str(out)],
        capture_stdout=True,
        capture_stderr=True,
        env={**os.environ, "ETCDCTL_API": "3"},
    )
    return trio.current_time() - start


@dataclass(frozen=True)
class Recovered:
    """One ``node recover`` run, in seconds from its process's spawn."""

    #: The owner's first call answered (the register ticket).
    answered: float
    #: Its log's first line, as etcdctl starts (the interpreter, the
    #: check's imports), "restored" (etcdctl done, the rest imported, the
    #: data in place), "recovered from" (the node's etcd started, its
    #: curator prepared the keyspace) and "this curator leads".
    started: float
    restored: float
    prepared: float
    leads: float
    #: The owner's ``nodes`` listing every record, after its first answer.
    listed: float


def _logged_at(log: Path, text: str) -> float:
    """Unix time of the first line of ``log`` that holds ``text``."""
    for line in log.read_text(errors="replace").splitlines():
        if text in line:
            at = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            return at.timestamp()
    raise RuntimeError(f"{log}: no line with {text!r}")


async def _ours_recover(
    root: Root, key_file: Path, snapshot: Path, log: Path, nodes: int, curator_port: int
) -> Recovered:
    """The node's etcd data deleted; ``node recover`` until the owner is answered."""
    shutil.rmtree(root.data.etcd.data, ignore_errors=True)
    key = pki.decode_private_key(await trio.Path(key_file).read_bytes())
    # The owner's files and TLS identity, read before: an owner at a
    # terminal has them; each look below only connects and calls.
    owner_access = load_owner(root, key)
    await owner_access.tls_context()
    spawned = time.time()
    start = trio.current_time()
    node = NodeProc(log, "recover", "--root", str(root.path), "--snapshot", str(snapshot))
    try:

        async def listens() -> bool:
            if node.process.poll() is not None:
                raise RuntimeError(f"node recover exited; see {log}")
            try:
                stream = await trio.open_tcp_stream("127.0.0.1", curator_port)
            except OSError:
                return False
            await stream.aclose()
            return True

        async def answers() -> bool:
            try:
                async with owner_access.open() as owner:
                    await owner.ticket()
                    return True
            except RPCError:
                return False

        # The owner's client retries a curator that does not answer with
        # waits of its own: first the port, polled here.
        await _until(listens)
        await _until(answers)
        answered = trio.current_time() - start
        async with owner_access.open() as owner:
            listing = trio.current_time()
            rows = await owner.nodes()
            listed = trio.current_time() - listing
        if len(rows) != nodes + 1:
            raise RuntimeError(f"the owner sees {len(rows)} nodes, not {nodes + 1}")
    finally:
        await node.stop()
    return Recovered(
        answered=answered,
        started=_logged_at(log, "restoring") - spawned,
        restored=_logged_at(log, "restored ") - spawned,
        prepared=_logged_at(log, "recovered from") - spawned,
        leads=_logged_at(log, "this curator leads") - spawned,
        listed=listed,
    )


async def main(nodes: int, runs: int, keep: bool) -> None:
    base = Path(tempfile.mkdtemp(prefix="bench-recover-"))
    try:
        await _measure(base, nodes, runs)
    finally:
        if keep:
            print(f"kept the nodes' logs and data in {base}", file=sys.stderr)
        else:
            shutil.rmtree(base, ignore_errors=True)


async def _measure(base: Path, nodes: int, runs: int) -> None:
    root = Root(base / "n")
    key_file = base / "owner.pem"
    ports = [str(free_loopback_port()) for _ in range(3)]
    first = NodeProc(
        base / "bootstrap.log",
        *("bootstrap", "--root", str(root.path), "--address", "127.0.0.1"),
        *("--owner-key-out", str(key_file), "--insecure-seal", "--raft-tuning", "20,200"),
        *("--peer-port", ports[0], "--curator-port", ports[1], "--debug-port", ports[2]),
    )
    try:

        async def leads() -> bool:
            return first.logged("this curator leads")

        await _until(leads)
        print(f"writing {nodes} node records...", file=sys.stderr)
        await _fill(root.ephemeral.consensus / SOCKET_NAME, nodes)
        snapshot = base / "cluster.snap"
        ours_snap = statistics.median(
            [await _ours_snapshot(root, base / f"s{i}.snap") for i in range(runs)]
        )
        shutil.copyfile(base / "s0.snap", snapshot)
        shutil.copyfile(base / "s0.snap.manifest", base / "cluster.snap.manifest")
    finally:
        await first.stop()
    size = (await trio.Path(snapshot).stat()).st_size

    bare_times = []
    bare_snaps = []
    ours = []
    loads = [os.getloadavg()[0]]
    # Each run of ours right after one of the baseline's: on a shared
    # machine the load moves within seconds, and both then meet about the
    # same.
    for i in range(runs):
        async with trio.open_nursery() as nursery:
            elapsed, url = await _bare_recover(snapshot, base / f"bare{i}", nursery=nursery)
            bare_times.append(elapsed)
            bare_snaps.append(await _bare_snapshot(url, base / f"bare{i}.snap"))
            nursery.cancel_scope.cancel()
        ours.append(
            await _ours_recover(
                root, key_file, snapshot, base / f"recover{i}.log", nodes, int(ports[1])
            )
        )
        loads.append(os.getloadavg()[0])
    bare_recover, bare_snap = statistics.median(bare_times), statistics.median(bare_snaps)

    def median(field: str) -> float:
        return float(statistics.median(getattr(r, field) for r in ours))

    answered = median("answered")
    # (measure, seconds, its baseline's seconds, reported as a ratio)
    rows = [
        ("etcdctl snapshot save (baseline)", bare_snap, bare_snap, False),
        ("owner snapshot: start to durable", ours_snap, bare_snap, True),
        ("etcdctl restore + etcd start (baseline)", bare_recover, bare_recover, False),
        ("node recover to the owner answered", answered, bare_recover, True),
        # Without the interpreter's start and the check's imports (before
        # its first log line, as etcdctl starts), which etcd's Go binaries
        # do not pay: shown, not reported.
        ("  the same after etcdctl started", answered - median("started"), bare_recover, False),
    ]
    print(
        f"{nodes} node records, snapshot {size / 1024:.0f} KiB, median of {runs}"
        f" (runs interleaved; load average {min(loads):.1f} to {max(loads):.1f})"
    )
    print(f"{'measure':<42} {'value':>10} {'ratio':>8}")
    for name, value, baseline, reported in rows:
        print(f"{name:<42} {value * 1000:>7.0f} ms {value / baseline:>8.2f}")
        if reported:
            report("recover", name, value / baseline, "<= 3")
    print("node recover, from its spawn (from its log's times):")
    for name, field in (
        ("etcdctl started (interpreter, the check)", "started"),
        ("restored (etcdctl, imports, data in place)", "restored"),
        ("prepared (its etcd started, its curator)", "prepared"),
        ("its curator leads", "leads"),
    ):
        print(f"  {name:<44} {median(field) * 1000:>7.0f} ms")
    print(f"  then the owner's nodes, {nodes + 1} rows {median('listed') * 1000:>18.0f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000, help="node records (1000)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each measure (3)")
    parser.add_argument("--keep", action="store_true", help="keep the logs and data")
    args = parse_args(parser, {"nodes": 20, "runs": 1})
    logging.basicConfig(level=logging.ERROR)
    trio.run(main, args.nodes, args.runs, args.keep)
