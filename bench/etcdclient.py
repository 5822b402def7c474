"""The node's etcd client: JSON gateway against native gRPC, on one etcd, in one run.

    python -m bench.etcdclient [--calls 2000] [--events 2000] [--rounds 5]
                               [--grant-runs 0] [--smoke]

One etcd 3.4 (loopback raft timing) on a UNIX socket, and both clients of
:mod:`metropolis.consensus`: ``client`` (HTTP/1.1 to etcd's JSON gateway)
and ``bench.etcdgrpc`` (gRPC on HTTP/2 on the same socket). Measured, in
rounds that alternate the two (the machine's load drifts):

- Python CPU (``time.process_time``: this process only, not etcd) per
  unary call, for ``range`` of one key, ``put`` of one key and a one-key
  ``txn``, ``--calls`` of each per round, one after another;
- Python CPU per watch event received: a watch on a prefix, while a writer
  in *another* process (so its CPU is not counted) puts ``--events`` keys
  under it, one put at a time; counted from the first put until the last
  event arrived;
- with ``--grant-runs N`` (N > 0), ``bench.controlplane``'s membership half
  twice in subprocesses, its node processes using each client in turn
  (``--etcd-client``), and the grant ratio of each (grant, n2 in its own
  process, against bare etcd's add + start + promote).

Prints CPU per operation for each client and the ratio grpc / gateway
(the median over rounds of the per-round ratios): below 1 means the native
client costs less.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from bench import etcdgrpc as grpcclient
from bench.ratios import report
from bench.smoke import parse_args
from metropolis.consensus import client as gateway
from metropolis.consensus.client import Compare, Get, Put
from metropolis.consensus.localetcd import EtcdServer

CLIENTS: dict[str, type[gateway.Client] | type[grpcclient.Client]] = {
    "gateway": gateway.Client,
    "grpc": grpcclient.Client,
}


async def _cpu(fn: Callable[[], Awaitable[None]]) -> float:
    start = time.process_time()
    await fn()
    return time.process_time() - start


async def unary_cpu(name: str, socket: Path, calls: int) -> dict[str, float]:
    """CPU seconds per call of range, put and txn with client ``name``."""
    async with CLIENTS[name](socket) as etcd:
        await etcd.put("bench/key", "value")  # connected, warmed up
        await etcd.range("bench/key")

        async def ranges() -> None:
            for _ in range(calls):
                await etcd.range("bench/key")

        async def puts() -> None:
            for i in range(calls):
                await etcd.put("bench/key", str(i))

        async def txns() -> None:
            for i in range(calls):
                await etcd.txn(
                    [Compare.version("bench/key", ">", 0)],
                    [Put("bench/key", str(i))],
                    [Get("bench/key")],
                )

        return {
            "range": await _cpu(ranges) / calls,
            "put": await _cpu(puts) / calls,
            "txn": await _cpu(txns) / calls,
        }


async def watch_cpu(name: str, socket: Path, events: int, round_: int) -> float:
    """CPU seconds per watch event with client ``name``; the writer is another process."""
    prefix = f"watch/{name}/{round_}/"
    async with CLIENTS[name](socket) as etcd, etcd.watch(prefix, prefix=True) as watch:
        seen = 0
        writer = await trio.lowlevel.open_process(
            [sys.executable, "-m", "bench.etcdclient", "--writer", str(socket), prefix, str(events)]
        )
        try:
            start = time.process_time()
            async for response in watch:
                seen += len(response.events)
                if seen >= events:
                    break
            cpu = time.process_time() - start
        finally:
            with trio.CancelScope(shield=True):
                await writer.wait()
        if writer.returncode != 0:
            raise RuntimeError(f"writer exited with {writer.returncode}")
        return cpu / events


async def writer(socket: Path, prefix: str, events: int) -> None:
    """The watch measure's writer: ``events`` puts under ``prefix``, one at a time."""
    async with grpcclient.Client(socket) as etcd:
        for i in range(events):
            await etcd.put(f"{prefix}{i:06d}", "x")


def grant_ratio(client: str, runs: int) -> float:
    """``bench.controlplane``'s grant ratio (n2 in its own process) with ``client``."""
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as ratios:
        env = dict(os.environ, BENCH_RATIOS=ratios.name)
        argv = [sys.executable, "-m", "bench.controlplane", "--only", "membership"]
        argv += ["--runs", str(runs), "--etcd-client", client]
        subprocess.run(argv, check=True, env=env, stdout=sys.stderr)
        for line in ratios:
            row = json.loads(line)
            if row["measure"] == "grant, n2 in its own process":
                return float(row["ratio"])
    raise RuntimeError("bench.controlplane reported no grant ratio")


#: A ratio this close to 1 is the machine's noise between rounds, not a difference.
NOISE = 1.05


def verdict(ratios: dict[str, float]) -> str:
    """Which client the node should use, given grpc/gateway CPU ratios per operation."""
    worst = max(ratios, key=lambda op: ratios[op])
    if ratios[worst] <= NOISE:
        return (
            f"verdict: the native client is no slower (worst {worst}, {ratios[worst]:.2f}x):"
            " the node may switch to it"
        )
    return (
        f"verdict: the node keeps the JSON gateway: the native client costs "
        f"{ratios[worst]:.2f}x its CPU per {worst}"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e6:8.1f} us"


async def main(calls: int, events: int, rounds: int, grant_runs: int) -> None:
    figures: dict[str, dict[str, list[float]]] = {n: {} for n in CLIENTS}
    with tempfile.TemporaryDirectory(prefix="bench-etcdclient-") as tmp:
        async with trio.open_nursery() as nursery:
            etcd = EtcdServer(Path(tmp), nursery)
            await etcd.start()
            for r in range(rounds):
                # Alternate which client goes first.
                order = list(CLIENTS) if r % 2 == 0 else list(reversed(CLIENTS))
                for name in order:
                    for op, cpu in (await unary_cpu(name, etcd.socket_path, calls)).items():
                        figures[name].setdefault(op, []).append(cpu)
                    cpu = await watch_cpu(name, etcd.socket_path, events, r)
                    figures[name].setdefault("watch event", []).append(cpu)
            nursery.cancel_scope.cancel()
    print(f"{'Python CPU per operation':<28} {'gateway':>11} {'grpc':>11} {'grpc/gateway':>13}")
    ratios: dict[str, float] = {}
    for op in figures["gateway"]:
        old, new = figures["gateway"][op], figures["grpc"][op]
        ratio = ratios[op] = statistics.median(n / o for n, o in zip(new, old, strict=True))
        print(
            f"{op:<28} {_ms(statistics.median(old))} {_ms(statistics.median(new))} {ratio:>13.2f}"
        )
        report("etcdclient", f"{op} CPU grpc/gateway", ratio, "<= 1")
    print(verdict(ratios))
    if grant_runs:
        ratios = {name: grant_ratio(name, grant_runs) for name in CLIENTS}
        print(
            f"{'grant ratio (controlplane)':<28} {ratios['gateway']:>11.2f} "
            f"{ratios['grpc']:>11.2f} {ratios['grpc'] / ratios['gateway']:>13.2f}"
        )
        report("etcdclient", "grant ratio grpc/gateway", ratios["grpc"] / ratios["gateway"], "<= 1")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--writer":
        trio.run(writer, Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
        raise SystemExit(0)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="unary calls per op and round")
    parser.add_argument("--events", type=int, default=2000, help="watch events per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, alternating (default 5)")
    parser.add_argument(
        "--grant-runs",
        type=int,
        default=0,
        help="grants per client in bench.controlplane (default 0: not measured)",
    )
    args = parse_args(parser, {"calls": 20, "events": 20, "rounds": 1, "grant_runs": 0})
    logging.basicConfig(level=logging.ERROR)
    trio.run(main, args.calls, args.events, args.rounds, args.grant_runs)
