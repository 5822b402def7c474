"""Control-plane start against bare etcd, measured in one run.

    python -m bench.controlplane [--runs 5]

Each on a fresh directory, ``--runs`` times, each node start right after
its baseline (interleaved: the machine's load drifts); figures are medians,
ratios the median of the per-pair ratios:

- baseline: a bare ``etcd`` (plain peers, new data dir) until it answers on
  its UNIX socket; and the same etcd restarted on its own data;
- bootstrap to home: a role server on a root holding only a bootstrap
  intent, until its membership is home with local consensus and curator
  (etcd started with peer TLS, cluster created in etcd, credentials,
  directory, sealed configuration and roles fsynced); and until the
  curator leads;
- run to home: the same role server restarted on what the bootstrap left
  (ratio against the bare restart).

In-process (no Python start-up): the node's own work is what is measured.
All etcds use the loopback raft timing (heartbeat 20 ms, election 200 ms).
Prints one table; each figure is also given as a ratio to its baseline.
Goal: <= 1.5x.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
from pathlib import Path

import trio

from bench.consensus_start import bare_etcd_start
from metropolis.curator.election import Leader
from metropolis.localstorage import Root
from metropolis.roleserve import disk
from metropolis.roleserve.localnode import prepare_loopback_bootstrap
from metropolis.roleserve.node import RoleServer
from metropolis.supervisor import open_supervisor

logger = logging.getLogger("bench.controlplane")


async def node_start(root: Root) -> tuple[float, float]:
    """Seconds until home with a running local control plane, and until the curator leads."""
    start = trio.current_time()
    # Reading the root is part of the node's start, as for `node run`.
    server = RoleServer(root, disk.load(root))
    async with open_supervisor(server.run, name="role"):
        with server.membership.watch() as w:
            membership = await w.get(
                lambda m: m.home and m.local_consensus is not None and m.local_curator is not None
            )
        assert membership.local_consensus is not None and membership.local_curator is not None
        await membership.local_consensus.wait_running()
        home = trio.current_time() - start
        with membership.local_curator.election.watch() as e:
            await e.get(lambda s: isinstance(s, Leader))
        leads = trio.current_time() - start
    return home, leads


async def main(runs: int) -> None:
    # Interleaved, so that a load change on this shared machine hits a node
    # start and its baseline alike; each ratio is the median of per-pair ratios.
    bare: list[float] = []
    boots: list[tuple[float, float]] = []
    bare_restart: list[float] = []
    restarts: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory(prefix="bench-cp-") as tmp:
        base = Path(tmp)
        roots = [Root(base / f"n{i}") for i in range(runs)]
        for i, root in enumerate(roots):
            prepare_loopback_bootstrap(root)
            bare.append(await bare_etcd_start(base / f"bare{i}"))
            boots.append(await node_start(root))
        for i, root in enumerate(roots):
            bare_restart.append(await bare_etcd_start(base / f"bare{i}"))
            restarts.append(await node_start(root))

    def row(name: str, values: list[float], baseline: list[float]) -> tuple[str, float, float]:
        ratio = statistics.median(v / b for v, b in zip(values, baseline, strict=True))
        return name, statistics.median(values), ratio

    rows = [
        row("etcd bare start (baseline)", bare, bare),
        row("bootstrap to home", [b[0] for b in boots], bare),
        row("bootstrap to curator leading", [b[1] for b in boots], bare),
        row("etcd bare restart (baseline)", bare_restart, bare_restart),
        row("run to home", [r[0] for r in restarts], bare_restart),
        row("run to curator leading", [r[1] for r in restarts], bare_restart),
    ]
    print(f"{'measure':<40} {'median':>10} {'ratio':>8}")
    for name, seconds, ratio in rows:
        print(f"{name:<40} {seconds * 1000:>7.0f} ms {ratio:>8.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    trio.run(main, args.runs)
