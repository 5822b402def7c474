"""The curator RPC stack against grpclib, measured in one run.

    python -m bench.rpc [--calls 2000] [--stream 5000] [--runs 3] [--smoke]

Each stack serves the management API's GetClusterInfo (a three-node
directory and a CA certificate, ~0.5 KiB) and GetNodes (a stream of node
records) over Ed25519 mutual TLS on loopback, to a client in the same
process on one connection:

- baseline: grpclib on plain asyncio (server and client; the best case
  for the library, with no Trio anywhere: its loop is asyncio's own
  selector loop, not the one trio-asyncio's event loop policy would hand
  ``asyncio.run``, which runs on Trio's scheduler and cost grpclib about
  a fifth more CPU per unary call);
- grpclib via trio-asyncio: the same grpclib server and client, but the
  handler runs in Trio and the caller is Trio code, which is how the curator
  would use it (option 1 in ``metropolis.rpc``'s docstring);
- metropolis.rpc: our h2-on-Trio server and client.

Figures: ``--calls`` sequential unary calls, and one stream of ``--stream``
messages; the median of ``--runs`` per figure, as seconds and as a ratio
to the baseline (lower is better). The seconds are CPU time of this process
(server and client both live in it), not wall time: on a shared machine
wall time mostly measures the other tenants, while CPU per call is what a
curator serving many nodes pays.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpclib.client
import grpclib.server
import trio
import trio_asyncio

from bench.grpclibmanagement import ManagementBase, ManagementStub
from bench.ratios import report
from bench.smoke import parse_args
from metropolis import identity, pki
from metropolis.proto import common, management
from metropolis.rpc import (
    CallContext,
    Endpoint,
    Leadership,
    Server,
    ServerSecurity,
    client_context,
    methods,
    open_client,
    server_context,
)


def _credentials(ca_key: Any, ca: Any) -> identity.NodeCredentials:
    key = pki.generate_key()
    cert = pki.issue_certificate(
        ca_key, ca, key.public_key(), identity.node_id(key.public_key()), pki.Usage.PEER
    )
    return identity.NodeCredentials(key, cert, ca)


CA_KEY = pki.generate_key()
CA = pki.new_ca(CA_KEY, "bench CA")
SERVER = _credentials(CA_KEY, CA)
OWNER_KEY = pki.generate_key()
OWNER_CERT = pki.issue_certificate(CA_KEY, CA, OWNER_KEY.public_key(), "owner", pki.Usage.CLIENT)

INFO = management.GetClusterInfoResponse(
    cluster_directory=common.ClusterDirectory(
        nodes=[
            common.ClusterDirectoryNode(
                public_key=bytes([i]) * 32,
                addresses=[common.ClusterDirectoryNodeAddress(host=f"10.0.0.{i}")],
            )
            for i in range(3)
        ]
    ),
    ca_certificate=pki.encode_certificate(CA, pki.Encoding.DER),
)
NODE = management.Node(
    pubkey=b"k" * 32,
    state=common.NodeState.UP,
    status=common.NodeStatus(external_address="10.0.0.1"),
    roles=common.NodeRoles(consensus_member=common.NodeRolesConsensusMember()),
)


def _contexts() -> tuple[Any, Any]:
    return server_context(SERVER), client_context(CA, OWNER_CERT, OWNER_KEY)


async def _timed(fn: Callable[[], Any]) -> float:
    start = time.process_time()
    await fn()
    return time.process_time() - start


# --- baseline: grpclib on asyncio -----------------------------------------------------------


class _AsyncioManagement(ManagementBase):
    async def get_cluster_info(
        self, message: management.GetClusterInfoRequest
    ) -> management.GetClusterInfoResponse:
        return INFO

    async def get_nodes(
        self, message: management.GetNodesRequest
    ) -> AsyncIterator[management.Node]:
        for _ in range(int(message.filter)):
            yield NODE


async def _grpclib_figures(calls: int, stream: int) -> tuple[float, float]:
    assert type(asyncio.get_running_loop()) is asyncio.SelectorEventLoop
    # Importing trio_asyncio installs an event loop policy whose
    # get_event_loop() knows only its own loops; grpclib calls it from
    # protocol callbacks, so register plain asyncio's running loop.
    asyncio.set_event_loop(asyncio.get_running_loop())
    server_ctx, client_ctx = _contexts()
    server = grpclib.server.Server([_AsyncioManagement()])
    await server.start("127.0.0.1", 0, ssl=server_ctx)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    channel = grpclib.client.Channel("127.0.0.1", port, ssl=client_ctx)
    stub = ManagementStub(channel)
    try:
        await stub.get_cluster_info(management.GetClusterInfoRequest())  # connect

        async def unary() -> None:
            for _ in range(calls):
                await stub.get_cluster_info(management.GetClusterInfoRequest())

        async def streamed() -> None:
            n = 0
            async for _ in stub.get_nodes(management.GetNodesRequest(filter=str(stream))):
                n += 1
            assert n == stream

        start = time.process_time()
        await unary()
        t_unary = time.process_time() - start
        start = time.process_time()
        await streamed()
        return t_unary, time.process_time() - start
    finally:
        channel.close()
        server.close()
        await server.wait_closed()


# --- grpclib with Trio on both ends, across trio-asyncio -----------------------------------


async def _trio_info() -> management.GetClusterInfoResponse:
    await trio.lowlevel.checkpoint()
    return INFO


class _BridgedManagement(ManagementBase):
    async def get_cluster_info(
        self, message: management.GetClusterInfoRequest
    ) -> management.GetClusterInfoResponse:
        result: management.GetClusterInfoResponse = await trio_asyncio.trio_as_aio(_trio_info)()
        return result

    async def get_nodes(
        self, message: management.GetNodesRequest
    ) -> AsyncIterator[management.Node]:
        # A Trio producer feeding the asyncio stream through a channel pair.
        send, receive = trio.open_memory_channel[management.Node](0)

        async def produce() -> None:
            async with send:
                for _ in range(int(message.filter)):
                    await send.send(NODE)

        async def pull() -> management.Node | None:
            try:
                return await receive.receive()
            except trio.EndOfChannel:
                return None

        task = asyncio.ensure_future(trio_asyncio.trio_as_aio(produce)())
        try:
            while (node := await trio_asyncio.trio_as_aio(pull)()) is not None:
                yield node
        finally:
            await task


async def _bridged_figures(calls: int, stream: int) -> tuple[float, float]:
    server_ctx, client_ctx = _contexts()
    async with trio_asyncio.open_loop():

        async def setup() -> tuple[grpclib.server.Server, grpclib.client.Channel, ManagementStub]:
            server = grpclib.server.Server([_BridgedManagement()])
            await server.start("127.0.0.1", 0, ssl=server_ctx)
            port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            channel = grpclib.client.Channel("127.0.0.1", port, ssl=client_ctx)
            return server, channel, ManagementStub(channel)

        server, channel, stub = await trio_asyncio.aio_as_trio(setup)()
        call = trio_asyncio.aio_as_trio(stub.get_cluster_info)
        try:
            await call(management.GetClusterInfoRequest())

            async def unary() -> None:
                for _ in range(calls):
                    await call(management.GetClusterInfoRequest())

            async def streamed() -> None:
                n = 0
                request = management.GetNodesRequest(filter=str(stream))
                async for _ in trio_asyncio.aio_as_trio(stub.get_nodes(request)):
                    n += 1
                assert n == stream

            return await _timed(unary), await _timed(streamed)
        finally:

            async def teardown() -> None:
                channel.close()
                server.close()
                await server.wait_closed()

            await trio_asyncio.aio_as_trio(teardown)()


# --- metropolis.rpc -----------------------------------------------------------------------


async def _ours_figures(calls: int, stream: int) -> tuple[float, float]:
    server_ctx, client_ctx = _contexts()
    # The curator's hooks answer from memory (see ServerSecurity).
    owner_key = pki.public_key_bytes(OWNER_KEY)
    security = ServerSecurity(
        owner_key=lambda: owner_key,
        crl=lambda: None,
        leadership=lambda: Leadership(is_leader=True),
    )
    server = Server(server_ctx, security)

    async def info(
        req: management.GetClusterInfoRequest, ctx: CallContext
    ) -> management.GetClusterInfoResponse:
        return INFO

    async def nodes(
        req: management.GetNodesRequest, ctx: CallContext, send: Callable[[management.Node], Any]
    ) -> None:
        for _ in range(int(req.filter)):
            await send(NODE)

    server.unary(methods.GET_CLUSTER_INFO, info)
    server.stream(methods.GET_NODES, nodes)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        async with open_client([Endpoint("127.0.0.1", port)], client_ctx) as client:
            await client.unary(methods.GET_CLUSTER_INFO, management.GetClusterInfoRequest())

            async def unary() -> None:
                for _ in range(calls):
                    await client.unary(methods.GET_CLUSTER_INFO, management.GetClusterInfoRequest())

            async def streamed() -> None:
                n = 0
                request = management.GetNodesRequest(filter=str(stream))
                async with client.stream(methods.GET_NODES, request) as s:
                    async for _ in s:
                        n += 1
                assert n == stream

            figures = await _timed(unary), await _timed(streamed)
        nursery.cancel_scope.cancel()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--stream", type=int, default=5000)
    parser.add_argument("--runs", type=int, default=3)
    args = parse_args(parser, {"calls": 10, "stream": 10, "runs": 1})

    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    results: dict[str, list[tuple[float, float]]] = {"baseline": [], "bridged": [], "ours": []}
    # Interleaved, so that load from other processes spreads over all three.
    for _ in range(args.runs):
        with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
            results["baseline"].append(runner.run(_grpclib_figures(args.calls, args.stream)))
        results["bridged"].append(trio.run(_bridged_figures, args.calls, args.stream))
        results["ours"].append(trio.run(_ours_figures, args.calls, args.stream))

    medians = {
        name: (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
        for name, runs in results.items()
    }
    base_unary, base_stream = medians["baseline"]
    labels = {
        "baseline": "grpclib on asyncio (baseline)",
        "bridged": "grpclib via trio-asyncio",
        "ours": "metropolis.rpc (h2 on Trio)",
    }
    print(
        f"{args.calls} unary calls, a stream of {args.stream}; "
        f"CPU seconds, median of {args.runs} runs; load {load} before, "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
        + " after"
    )
    columns = (("unary s", 9), ("ratio", 6), ("calls/CPU s", 11), ("stream s", 9), ("ratio", 6))
    print(f"{'stack':32} " + " ".join(f"{name:>{width}}" for name, width in columns))
    for name, (unary, streamed) in medians.items():
        print(
            f"{labels[name]:32} {unary:9.3f} {unary / base_unary:6.2f} "
            f"{args.calls / unary:11.0f} {streamed:9.3f} {streamed / base_stream:6.2f}"
        )
    unary, streamed = medians["ours"]
    report("rpc", "metropolis.rpc unary CPU / grpclib's", unary / base_unary, "<= 1.0")
    report("rpc", "metropolis.rpc stream CPU / grpclib's", streamed / base_stream, "<= 1.5")


if __name__ == "__main__":
    main()
