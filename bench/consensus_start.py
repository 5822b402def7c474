"""Consensus start-up and client cost against bare etcd, measured in one run.

    python -m bench.consensus_start [--runs 5] [--puts 300] [--smoke]

Start-up, each on a fresh directory, median of ``--runs``:

- baseline: a bare ``etcd`` (plain peers, new data dir) until it answers on
  its UNIX socket;
- bootstrap: the consensus service on an empty node until its status says
  running (one etcd start, with peer TLS; the PKI is made before and stored
  in etcd after), with supervisor, CRL watcher and promoter;
- restart: the same service again on the data the bootstrap left, against
  bare etcd restarted on its own data (the second baseline).

Client, against one running etcd: ``--puts`` sequential puts through our
:class:`~metropolis.consensus.client.Client` against the same JSON POSTs
sent with a bare ``httpx`` client on the same socket.

All etcds use the loopback raft timing (heartbeat 20 ms, election 200 ms).
Prints one table; each figure is also given as a ratio to its baseline.
"""

from __future__ import annotations

import argparse
import base64
import logging
import statistics
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import trio

from bench.ratios import report
from bench.smoke import parse_args
from common.net import free_loopback_port
from metropolis import pki
from metropolis.consensus import Config, Service
from metropolis.consensus.client import Client
from metropolis.consensus.localetcd import LOOPBACK_TUNING
from metropolis.consensus.process import ProcessConfig, run_etcd
from metropolis.localstorage import Root
from metropolis.supervisor import open_supervisor

logger = logging.getLogger("bench.consensus_start")


_PORTS: dict[Path, int] = {}


def _bare_config(directory: Path) -> ProcessConfig:
    # A restart must advertise the peer URL its data was created with.
    port = _PORTS.setdefault(directory, free_loopback_port())
    return ProcessConfig.standalone("bench", directory, port, LOOPBACK_TUNING)


async def bare_etcd_start(directory: Path) -> float:
    """A bare etcd until it answers (a restart when ``directory`` has its data)."""
    config = _bare_config(directory)
    async with trio.open_nursery() as nursery:
        start = trio.current_time()
        await nursery.start(run_etcd, config, logger)
        elapsed = trio.current_time() - start
        nursery.cancel_scope.cancel()
    return elapsed


def _service_config(root: Root, port: int) -> Config:
    key_file = root.path / "bench-node-key.pem"
    if key_file.exists():
        key = pki.decode_private_key(key_file.read_bytes())
    else:
        key = pki.generate_key()
        key_file.write_bytes(pki.encode_private_key(key))
    return Config(
        data=root.data.etcd,
        ephemeral=root.ephemeral.consensus,
        node_private_key=key,
        peer_address=f"127.0.0.1:{port}",
        tuning=LOOPBACK_TUNING,
    )


async def service_start(root: Root, port: int) -> float:
    root.create()
    service = Service(_service_config(root, port))
    start = trio.current_time()
    async with open_supervisor(service.run, name="consensus"):
        with service.status.watch() as watcher:
            await watcher.get(lambda s: s.running)
        elapsed = trio.current_time() - start
    return elapsed


async def puts_with_client(socket: Path, count: int) -> float:
    async with Client(socket) as client:
        start = trio.current_time()
        for i in range(count):
            await client.put(f"bench/{i}", "value")
        return trio.current_time() - start


async def puts_with_httpx(socket: Path, count: int) -> float:
    transport = httpx.AsyncHTTPTransport(uds=str(socket))
    async with httpx.AsyncClient(transport=transport, base_url="http://etcd") as http:
        value = base64.b64encode(b"value").decode()
        start = trio.current_time()
        for i in range(count):
            key = base64.b64encode(f"bench/{i}".encode()).decode()
            response = await http.post("/v3/kv/put", json={"key": key, "value": value})
            response.raise_for_status()
        return trio.current_time() - start


async def _median(runs: int, measure: Callable[[int], Awaitable[float]]) -> float:
    return statistics.median([await measure(i) for i in range(runs)])


async def main(runs: int, puts: int) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-consensus-") as tmp:
        base = Path(tmp)
        bare = await _median(runs, lambda i: bare_etcd_start(base / f"bare{i}"))
        bare_restart = await _median(runs, lambda i: bare_etcd_start(base / f"bare{i}"))

        ports = [free_loopback_port() for _ in range(runs)]
        bootstrap = await _median(runs, lambda i: service_start(Root(base / f"n{i}"), ports[i]))
        restart = await _median(runs, lambda i: service_start(Root(base / f"n{i}"), ports[i]))

        config = _bare_config(base / "puts")
        async with trio.open_nursery() as nursery:
            await nursery.start(run_etcd, config, logger)
            raw = await puts_with_httpx(config.socket_path, puts)
            ours = await puts_with_client(config.socket_path, puts)
            nursery.cancel_scope.cancel()

    rows = [
        ("etcd bare start (baseline)", f"{bare * 1000:.0f} ms", 1.0),
        ("consensus bootstrap, empty node", f"{bootstrap * 1000:.0f} ms", bootstrap / bare),
        ("etcd bare restart (baseline)", f"{bare_restart * 1000:.0f} ms", 1.0),
        ("consensus restart, existing data", f"{restart * 1000:.0f} ms", restart / bare_restart),
        ("put via raw httpx (baseline)", f"{puts / raw:.0f} op/s", 1.0),
        # Time ratio: how much longer our client takes for the same puts.
        ("put via Client (time ratio)", f"{puts / ours:.0f} op/s", ours / raw),
    ]
    print(f"{'measure':<40} {'value':>12} {'ratio':>8}")
    for name, value, ratio in rows:
        print(f"{name:<40} {value:>12} {ratio:>8.2f}")
        if not name.endswith("(baseline)"):
            report("consensus_start", name, ratio)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--puts", type=int, default=300)
    args = parse_args(parser, {"runs": 1, "puts": 5})
    logging.basicConfig(level=logging.ERROR)
    trio.run(main, args.runs, args.puts)
