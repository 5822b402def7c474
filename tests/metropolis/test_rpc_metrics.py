"""A Server with :class:`RPCMetrics` counts every call by method and status,
with latencies; a path no method serves counts as ``unknown``, whatever it is."""

from __future__ import annotations

import pytest
import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from metropolis.proto.common import ClusterDirectory, ClusterDirectoryNode
from metropolis.rpc import (
    Access,
    CallContext,
    Endpoint,
    Leadership,
    Method,
    RPCError,
    RPCMetrics,
    Server,
    ServerSecurity,
    Status,
    client_context,
    open_client,
    server_context,
)
from metropolis.rpc.metrics import UNKNOWN_METHOD
from tests.fixtures.rpc import ClusterPKI

OK = Method("/test.Test/Ok", ClusterDirectory, ClusterDirectory, Access.NODE)
FAIL = Method("/test.Test/Fail", ClusterDirectory, ClusterDirectory, Access.NODE)


async def test_calls_are_counted_by_method_and_status() -> None:
    cluster = ClusterPKI.new()
    metrics = RPCMetrics()
    security = ServerSecurity(
        owner_key=lambda: None, crl=lambda: None, leadership=lambda: Leadership(True)
    )
    server = Server(server_context(cluster.server), security, metrics=metrics, name="test")

    async def ok(req: ClusterDirectory, ctx: CallContext) -> ClusterDirectory:
        return req

    async def fail(req: ClusterDirectory, ctx: CallContext) -> ClusterDirectory:
        raise RPCError(Status.NOT_FOUND, "no")

    server.unary(OK, ok)
    server.unary(FAIL, fail)
    node = cluster.node
    context = client_context(cluster.ca, node.certificate, node.private_key)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        async with open_client([Endpoint("127.0.0.1", port)], context) as client:
            for _ in range(3):
                await client.unary(OK, ClusterDirectory())
            with pytest.raises(RPCError):
                await client.unary(FAIL, ClusterDirectory())
            for i in range(5):
                # Paths a caller makes up must not become label values.
                made_up = Method(f"/x.Y/Z{i}", ClusterDirectory, ClusterDirectory, Access.NODE)
                with pytest.raises(RPCError) as e:
                    await client.unary(made_up, ClusterDirectory(nodes=[ClusterDirectoryNode()]))
                assert e.value.code is Status.UNIMPLEMENTED
        nursery.cancel_scope.cancel()

    assert metrics.calls("test", OK.path, "OK") == 3
    assert metrics.calls("test", FAIL.path, "NOT_FOUND") == 1
    assert metrics.calls("test", UNKNOWN_METHOD, "UNIMPLEMENTED") == 5
    registry = CollectorRegistry()
    registry.register(metrics)
    families = {
        f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())
    }
    calls = {
        (s.labels["method"], s.labels["code"]): s.value
        for s in families["metropolis_rpc_calls"].samples
    }
    assert calls == {
        (OK.path, "OK"): 3,
        (FAIL.path, "NOT_FOUND"): 1,
        ("unknown", "UNIMPLEMENTED"): 5,
    }
    histogram = {
        (s.name, s.labels["method"], s.labels.get("le")): s.value
        for s in families["metropolis_rpc_call_duration_seconds"].samples
    }
    assert histogram[("metropolis_rpc_call_duration_seconds_count", OK.path, None)] == 3
    assert histogram[("metropolis_rpc_call_duration_seconds_bucket", OK.path, "+Inf")] == 3
    # Cumulative buckets never decrease.
    bounds = [
        v
        for (name, method, le), v in histogram.items()
        if name.endswith("_bucket") and method == OK.path
    ]
    assert bounds == sorted(bounds)
